"""A request handed from one engine to another mid-generation (`Resume`, prefill/decode disaggregation): engine A
draws the first token, engine B goes on from it, and the tokens equal one engine's run on every tiny architecture:
greedy, seeded at temperature 1.0 with logprobs, and with a grammar. With a shared host tier B finds the prompt
blocks A computed; a resume that cannot be served is refused naming `resume`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from pagoda.server.engine import RequestRejectedError
from pagoda.server.handoff import Resume
from pagoda.server.llm import LLM
from pagoda.server.lora import LoRARequest
from pagoda.server.outputs import RequestOutput
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.structured import StructuredOutputsParams
from pagoda.server.testing import ARCHS, make_tiny_model
from pagoda.server.testing.tiny_lora import make_tiny_lora

BS = 4
MAX_TOKENS = 7
# A sliding-window architecture's window (tiny Gemma 3 and Mistral use 8 or less) is crossed by the longest.
LENGTHS = (3, 8, 13, 22)


def prompts_of(lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths (ids clear of the special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every tiny architecture."""
    root = tmp_path_factory.mktemp("handoff-models")
    return {arch: make_tiny_model(arch, root / arch) for arch in ARCHS}


def make_llm(model_dir: Path, shm: Path | None = None, **kwargs: Any) -> LLM:
    """float32, blocks of 4; with `shm`, a host tier on that shared file."""
    args: dict[str, Any] = {"block_size": BS, "num_kv_blocks": 64, "max_model_len": 64, "dtype": "float32"}
    if shm is not None:
        args.update(kv_offloading_size=8 / 1024, kv_offloading_shm=str(shm))
    args.update(kwargs)
    return LLM(str(model_dir), **args)


def run(
    llm: LLM, request_id: str, prompt: Sequence[int], params: SamplingParams, resume: Resume | None = None
) -> RequestOutput:
    """One request through `llm`'s engine, stepped to its end; its last output."""
    engine = llm.engine
    engine.add_request(request_id, prompt, params, resume=resume)
    last: RequestOutput | None = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                last = out
    assert last is not None and last.finished
    return last


def handed_off(
    a: LLM, b: LLM, request_id: str, prompt: Sequence[int], params: SamplingParams
) -> RequestOutput:
    """The first token drawn by `a` (max_tokens 1), the rest by `b` going on from it."""
    seed = 1234 if params.seed is None else params.seed
    first = run(a, request_id, prompt, dataclasses.replace(params, max_tokens=1, seed=seed)).outputs[0]
    assert first.finish_reason == "length"
    resume = Resume(
        list(first.token_ids),
        seed,
        None if first.logprobs is None else list(first.logprobs),
        first.cumulative_logprob,
    )
    return run(b, request_id, prompt, dataclasses.replace(params, seed=seed), resume)


@pytest.mark.parametrize("arch", ARCHS)
def test_handed_off_tokens_equal_one_engine(model_dirs: dict[str, Path], arch: str, tmp_path: Path) -> None:
    """Greedy, and seeded at temperature 1.0 with logprobs: every prompt length (inside a block, at a block's end,
    across a sliding window) continues on engine B exactly as one engine runs it; B finds A's full prompt blocks
    in the shared host tier (its cached tokens) and computes only the rest."""
    prompts = prompts_of(LENGTHS, seed=7)
    shm = tmp_path / "tier"
    one, a, b = make_llm(model_dirs[arch]), make_llm(model_dirs[arch], shm), make_llm(model_dirs[arch], shm)
    cases = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        "seeded": SamplingParams(
            temperature=1.0, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2
        ),
    }
    try:
        for name, params in cases.items():
            for i, prompt in enumerate(prompts):
                want = run(one, f"{name}-{i}", prompt, params)
                got = handed_off(a, b, f"{name}-{i}", prompt, params)
                assert got.outputs[0].token_ids == want.outputs[0].token_ids, (name, len(prompt))
                assert got.outputs[0].text == want.outputs[0].text
                assert got.outputs[0].finish_reason == "length"
                # Blocks holding prompt tokens only were A's (the last one too when the prompt fills it).
                assert got.num_cached_tokens == len(prompt) // BS * BS, (name, len(prompt))
                if name == "seeded":
                    got_lp, want_lp = got.outputs[0].logprobs, want.outputs[0].logprobs
                    assert got_lp is not None and want_lp is not None and len(got_lp) == MAX_TOKENS
                    for g, w in zip(got_lp, want_lp, strict=True):
                        assert g.keys() == w.keys()
                        # float32 logits of the same KV, summed in another order: a few ulps of the logits.
                        assert all(abs(g[t].logprob - w[t].logprob) < 1e-4 for t in g)
    finally:
        for llm in (one, a, b):
            llm.engine.close()


def test_a_handed_off_grammar_goes_on_from_the_first_token(model_dirs: dict[str, Path]) -> None:
    """The decode engine's grammar matcher takes the first token before drawing the second: seeded outputs under a
    regex equal one engine's and match it."""
    one, a, b = (make_llm(model_dirs["llama"]) for _ in range(3))
    params = SamplingParams(
        temperature=1.0, max_tokens=16, structured_outputs=StructuredOutputsParams(regex="[a-z]{4}-[0-9]{3}")
    )
    try:
        for seed in range(3):
            seeded = dataclasses.replace(params, seed=seed)
            want = run(one, f"r{seed}", [5, 17, 42], seeded).outputs[0]
            got = handed_off(a, b, f"r{seed}", [5, 17, 42], seeded).outputs[0]
            assert got.token_ids == want.token_ids and got.text == want.text
            assert len(got.text) == 8 and got.text[4] == "-", got.text
    finally:
        for llm in (one, a, b):
            llm.engine.close()


@pytest.mark.parametrize(
    ("params", "outputs"),
    [
        (SamplingParams(n=2, max_tokens=4), [9]),
        (SamplingParams(max_tokens=4, prompt_logprobs=1), [9]),
        (SamplingParams(max_tokens=4), []),
        (SamplingParams(max_tokens=2), [9, 10]),
    ],
)
def test_a_resume_that_cannot_be_served_is_refused_naming_it(
    model_dirs: dict[str, Path], params: SamplingParams, outputs: list[int]
) -> None:
    """n > 1, prompt logprobs, no outputs or max_tokens reached: RequestRejectedError naming `resume`, and the
    engine has taken nothing."""
    llm = make_llm(model_dirs["llama"])
    try:
        with pytest.raises(RequestRejectedError) as refused:
            llm.engine.add_request("r", [5, 6, 7], params, resume=Resume(outputs, 0))
        assert refused.value.param == "resume"
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.engine.close()


def run_all(
    llm: LLM, requests: Mapping[str, tuple[Sequence[int], SamplingParams, Resume | None]]
) -> dict[str, RequestOutput]:
    """Several requests through `llm`'s engine at once, stepped to their ends; each one's last output."""
    engine = llm.engine
    for request_id, (prompt, params, resume) in requests.items():
        engine.add_request(request_id, prompt, params, resume=resume)
    last: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            last[out.request_id] = out
    return last


def test_chunked_prefill_there_and_preemption_here(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Engine A prefills in chunks of 4 tokens; engine B's pool is too small for its six resumed requests at once,
    so it preempts and recomputes: every request still gets one engine's tokens."""
    prompts = prompts_of((9, 14, 17, 21, 11, 16), seed=9)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    shm = tmp_path / "tier"
    one = make_llm(model_dirs["llama"])
    a = make_llm(model_dirs["llama"], shm, max_num_batched_tokens=4, enable_chunked_prefill=True)
    b = make_llm(model_dirs["llama"], shm, num_kv_blocks=16)
    try:
        want = run_all(one, {f"r{i}": (p, params, None) for i, p in enumerate(prompts)})
        firsts = run_all(
            a, {f"r{i}": (p, dataclasses.replace(params, max_tokens=1), None) for i, p in enumerate(prompts)}
        )
        resumed = {
            f"r{i}": (p, params, Resume(list(firsts[f"r{i}"].outputs[0].token_ids), 3))
            for i, p in enumerate(prompts)
        }
        got = run_all(b, resumed)
        assert b.engine.get_stats().num_preemptions > 0
        for request_id, out in want.items():
            assert got[request_id].outputs[0].token_ids == out.outputs[0].token_ids, request_id
    finally:
        for llm in (one, a, b):
            llm.engine.close()


def test_a_lora_request_hands_off_on_its_adapter(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A request under a LoRA adapter: A draws its first token under it, B goes on under it (its blocks are salted
    by the adapter on both), and the tokens equal one engine's."""
    adapter = make_tiny_lora(model_dirs["llama"], tmp_path / "adapter", rank=4, seed=5)
    lora = LoRARequest("ad", 1, str(adapter))
    shm = tmp_path / "tier"
    one, a, b = (
        make_llm(model_dirs["llama"], None if i == 0 else shm, enable_lora=True, max_loras=1)
        for i in range(3)
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, lora_request=lora)
    prompt = prompts_of((13,), seed=2)[0]
    try:
        want = run(one, "l", prompt, params)
        got = handed_off(a, b, "l", prompt, params)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.num_cached_tokens == 12
        base = run(one, "base", prompt, dataclasses.replace(params, lora_request=None))
        assert base.outputs[0].token_ids != want.outputs[0].token_ids
    finally:
        for llm in (one, a, b):
            llm.engine.close()
