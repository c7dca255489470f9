"""A request that arrives with outputs already drawn (resumed from another engine: prefill/decode disaggregation)
is admitted like one preempted by recompute: its prompt and outputs are computed, and its next tokens are the
reference ones. A group still to fork, or outputs that reach max_tokens, are refused: nothing is queued."""

from __future__ import annotations

import pytest
from pagoda.blockalloc import BlockManager
from pagoda.scheduler import Request, RequestRejectedError, Scheduler, SchedulerConfig
from pagoda.scheduler.testing import SimSamplingParams, TokenCacheModel, reference_output, run_to_completion

BS = 4
MAX_LEN = 64


def make() -> tuple[Scheduler, TokenCacheModel]:
    """A scheduler over 32 blocks, and the model that checks every key it reads."""
    kv = BlockManager(32, BS)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=MAX_LEN)
    return Scheduler(config, kv), TokenCacheModel(32, BS, 0)


@pytest.mark.parametrize("num_outputs", [1, 3, 5])
def test_a_resumed_request_goes_on_with_the_reference_tokens(num_outputs: int) -> None:
    """Prompts of 11 tokens with 1, 3 or 5 reference outputs already drawn, beside a fresh request: each finishes
    with the reference outputs, the ones it came with first."""
    sched, model = make()
    params = SimSamplingParams(max_tokens=9)
    prompt = tuple(range(10, 21))
    want = reference_output(prompt, params, MAX_LEN)
    resumed = Request("resumed", prompt, params)
    for token in want[:num_outputs]:
        resumed.append_output_token(token)
    fresh = Request("fresh", tuple(range(40, 47)), params)
    sched.add_request(resumed)
    sched.add_request(fresh)
    result = run_to_completion(sched, model, max_steps=100)
    by_id = {r.request_id: r for r in result.finished}
    assert list(by_id["resumed"].output_token_ids) == want
    assert list(by_id["fresh"].output_token_ids) == reference_output(fresh.prompt_token_ids, params, MAX_LEN)


@pytest.mark.parametrize(("n", "num_outputs"), [(2, 1), (1, 4)])
def test_outputs_on_a_group_or_at_max_tokens_are_refused(n: int, num_outputs: int) -> None:
    """A request of n = 2 that comes with outputs, or one whose outputs reach max_tokens, is not fresh."""
    sched, _ = make()
    request = Request("r", (1, 2, 3), SimSamplingParams(max_tokens=4, n=n))
    for token in range(num_outputs):
        request.append_output_token(token + 5)
    with pytest.raises(RequestRejectedError, match="not fresh"):
        sched.add_request(request)
    assert not sched.has_unfinished_requests()
