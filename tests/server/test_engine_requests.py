"""The engine's per-request seam without a model: a fake executor drives a plain request and a beam group through
the same step loop, the step sampler routes their rows, and the grammar gate holds, admits and fails requests."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
import torch
import xgrammar as xgr
from pagoda.blockalloc import BlockManager
from pagoda.pagedkernel import get_backend
from pagoda.scheduler import Request, Scheduler, SchedulerConfig, SchedulerOutput
from pagoda.server.beam_search import BeamSearchParams
from pagoda.server.config import EngineConfig
from pagoda.server.engine import LLMEngine
from pagoda.server.engine.beams import BeamGroup
from pagoda.server.engine.executor import Executor
from pagoda.server.engine.grammar_gate import GrammarGate
from pagoda.server.engine.kv_cache import KVCache
from pagoda.server.engine.model_runner import ModelRunner, PromptHidden
from pagoda.server.engine.owners import RequestOwners
from pagoda.server.engine.request_factory import NewRequest, new_request
from pagoda.server.engine.requests import SchedulerParams
from pagoda.server.engine.setup import EngineParts
from pagoda.server.engine.step_sampler import StepSampler
from pagoda.server.models.base import CausalLM
from pagoda.server.outputs import RequestOutput
from pagoda.server.request_contract import EngineRequest
from pagoda.server.sampling import Sampler
from pagoda.server.sampling_params import SamplingParams, StructuredOutputsParams
from pagoda.server.structured import GrammarBitmask, StructuredOutputManager
from transformers import PreTrainedTokenizerBase

VOCAB = 400  # the fake model's logits width, padded past the tiny tokenizer's 384 tokens
PROMPT = (5, 17, 42, 9, 100)
MAX_TOKENS = 4


def peak(seq_len: int) -> int:
    """The token the fake model prefers after a context of `seq_len` tokens (never a special token)."""
    return 3 + (seq_len * 7) % (VOCAB - 3)


def fake_row(seq_len: int) -> torch.Tensor:  # float32 [VOCAB]
    """Logits falling away from the peak token; the special tokens 0-2 are never chosen."""
    distance = (torch.arange(VOCAB) - peak(seq_len)) % VOCAB
    row = -0.5 * distance.float()
    row[:3] = float("-inf")
    return row


class FakeModel(Executor):
    """An executor without a model: each sampled row's logits depend only on its chunk's context length."""

    def __init__(self) -> None:
        self.driver = cast(ModelRunner, None)  # the engine only keeps it as `engine.runner`
        self.num_blocks = 64
        self.num_host_blocks = 0
        self.steps: list[SchedulerOutput] = []

    def execute(
        self, output: SchedulerOutput, prompt_lens: Mapping[str, int]
    ) -> tuple[torch.Tensor, dict[str, PromptHidden]]:  # ([num_rows, VOCAB], no prompt hidden states)
        """One logits row per sample id of the step, in schedule order."""
        self.steps.append(output)
        rows = [fake_row(chunk.seq_len) for chunk in output.scheduled for _ in chunk.sample_ids]
        return (torch.stack(rows) if rows else torch.empty(0, VOCAB)), {}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_rows, VOCAB]
        """No LM head: these tests ask for no prompt logprobs."""
        raise AssertionError("no prompt logprobs here")

    def shutdown(self) -> None:
        """Nothing to stop."""


def make_engine(tokenizer: PreTrainedTokenizerBase) -> LLMEngine:
    """An engine over the fake model (no weights, no KV tensors)."""
    parts = EngineParts(
        model=cast(CausalLM, None),
        tokenizer=tokenizer,
        model_name="fake",
        model_path=Path("fake"),
        device=torch.device("cpu"),
        dtype=torch.float32,
        backend=get_backend("torch", "cpu"),
        # No KV tensors: only the cache's geometry is read (one full-attention group).
        kv_cache=cast(KVCache, SimpleNamespace(shape=SimpleNamespace(layout=None))),
        max_model_len=64,
        max_num_batched_tokens=256,
        vocab_size=VOCAB,
        eos_token_ids=frozenset({tokenizer.eos_token_id}),
    )
    return LLMEngine(EngineConfig(), parts, FakeModel())


def run(engine: LLMEngine, max_steps: int = 100) -> Iterator[RequestOutput]:
    """Step until no request is left, yielding every output."""
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return
        yield from engine.step()
    raise AssertionError("the engine did not finish")


def greedy_path(prompt_len: int, num_tokens: int) -> list[int]:
    """The tokens a greedy request gets from the fake model."""
    return [peak(prompt_len + i) for i in range(num_tokens)]


def test_a_plain_request_and_a_beam_group_run_through_one_step_loop(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """Side by side in one batch, the plain request streams its greedy tokens and the beam group reports once,
    finished, its best beam being that same greedy path; both are forgotten and free their blocks."""
    engine = make_engine(tokenizer)
    engine.add_request(
        "plain", PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    )
    beams = SamplingParams.for_beam_search(BeamSearchParams(3, MAX_TOKENS, ignore_eos=True), n=2)
    engine.add_request("beams", PROMPT, beams)
    assert engine.get_num_unfinished_requests() == 2
    outputs = list(run(engine))
    plain = [o for o in outputs if o.request_id == "plain"]
    beam = [o for o in outputs if o.request_id == "beams"]
    assert len(plain) == MAX_TOKENS and [o.finished for o in plain] == [False] * (MAX_TOKENS - 1) + [True]
    assert list(plain[-1].outputs[0].token_ids) == greedy_path(len(PROMPT), MAX_TOKENS)
    assert plain[-1].outputs[0].finish_reason == "length"
    (result,) = beam  # a beam search streams nothing
    assert result.finished and len(result.outputs) == 2
    assert list(result.outputs[0].token_ids) == greedy_path(len(PROMPT), MAX_TOKENS)
    assert all(len(o.token_ids) == MAX_TOKENS for o in result.outputs)
    assert result.outputs[0].token_ids != result.outputs[1].token_ids
    assert engine.get_num_unfinished_requests() == 0 and not engine.owners.seqs
    assert engine.kv_manager.stats().num_used_blocks == 0
    # Both requests' chunks were in the same steps: one loop drove them.
    executor = cast(FakeModel, engine.executor)
    assert {c.request_id for c in executor.steps[0].scheduled} == {"plain", "beams"}
    assert engine.get_stats().generation_tokens == MAX_TOKENS + 3 * MAX_TOKENS


def test_a_row_that_cannot_be_sampled_aborts_its_request_alone(
    tokenizer: PreTrainedTokenizerBase, caplog: pytest.LogCaptureFixture
) -> None:
    """NaN logits in one request's row on its second step abort that request (logged, keeping its first token);
    the request beside it gets all its tokens."""
    engine = make_engine(tokenizer)
    executor = cast(FakeModel, engine.executor)
    execute = executor.execute

    def poisoned(
        output: SchedulerOutput, prompt_lens: Mapping[str, int]
    ) -> tuple[torch.Tensor, dict[str, PromptHidden]]:  # ([num_rows, VOCAB], no prompt hidden states)
        logits, hidden = execute(output, prompt_lens)
        rows = [seq_id for chunk in output.scheduled for seq_id in chunk.sample_ids]
        if len(executor.steps) == 2:
            logits[rows.index("bad"), 7] = float("nan")
        return logits, hidden

    executor.execute = poisoned  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request("good", PROMPT, params)
    engine.add_request("bad", PROMPT, params)
    with caplog.at_level(logging.ERROR):
        finished = {o.request_id: o for o in run(engine) if o.finished}
    assert finished["bad"].outputs[0].finish_reason == "abort"
    assert list(finished["bad"].outputs[0].token_ids) == greedy_path(len(PROMPT), 1)
    assert list(finished["good"].outputs[0].token_ids) == greedy_path(len(PROMPT), MAX_TOKENS)
    assert "request bad aborted: cannot sample sample bad's next token: the model produced NaN" in caplog.text
    assert engine.get_num_unfinished_requests() == 0 and engine.kv_manager.stats().num_used_blocks == 0


def test_the_step_sampler_hands_logprob_rows_over_and_draws_the_rest(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """A plain request's rows are drawn (greedy: the argmax); a beam group's come to it as float32 log-softmax
    rows, its sequences held."""
    eos = frozenset({tokenizer.eos_token_id})
    plain = new_request(
        "p", None, PROMPT, SamplingParams(temperature=0.0, max_tokens=4), 0.0, tokenizer, eos, lambda _: 0
    )
    beam_params = SamplingParams.for_beam_search(BeamSearchParams(2, 4))
    group = new_request("b", None, PROMPT, beam_params, 0.0, tokenizer, eos, lambda _: 0)
    assert plain.grammar is None and group.grammar is None
    scheduler = Scheduler(SchedulerConfig(max_model_len=64, watermark=0.0), BlockManager(32, 4))
    owners = RequestOwners()
    for new in (plain, group):
        scheduler.add_request(new.request)
        owners.own(new.owner, len(PROMPT))
    assert group.owner.seq_ids == ("b", "b:1")
    scheduled = scheduler.schedule()
    step_sampler = StepSampler(Sampler("torch", "cpu"), GrammarBitmask(VOCAB, eos))
    rows = step_sampler.plan(scheduled, owners)
    assert rows.seq_ids == ("p", "b", "b:1") and rows.grammar is None
    assert rows.specs[0] is not None and rows.specs[1:] == (None, None)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    sampled = step_sampler.sample(rows, logits)
    assert sampled.drawn == (("p", int(logits[0].argmax()), None),)
    assert sampled.held == ("b", "b:1") and not sampled.failures.requests
    assert isinstance(group.owner, BeamGroup)
    for index, seq_id in ((1, "b"), (2, "b:1")):
        held = group.owner.rows[seq_id]
        assert held.dtype == torch.float32
        assert torch.allclose(held, torch.log_softmax(logits[index], dim=-1))


class Compilations:
    """A stand-in for the StructuredOutputManager: each compilation is the next of the given futures."""

    def __init__(self, *grammars: Future[xgr.CompiledGrammar]) -> None:
        self.grammars = list(grammars)

    def compile(self, params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """The next future."""
        return self.grammars.pop(0)


def gate_of(*grammars: Future[xgr.CompiledGrammar]) -> GrammarGate:
    """A gate whose compilations are `grammars`, in order."""
    return GrammarGate(cast(StructuredOutputManager, Compilations(*grammars)))


def held(gate: GrammarGate, request: Request, start: Callable[[xgr.CompiledGrammar], None]) -> None:
    """Offer the gate a constrained request; it must hold it."""
    owner = cast(EngineRequest, None)  # the gate never reads the owner
    assert gate.hold(NewRequest(owner, request, (StructuredOutputsParams(regex="[a-z]+"), start)))


def admit_ready(gate: GrammarGate, scheduler: Scheduler) -> list[str]:
    """What the engine does at a step's start: the released requests go to the scheduler (this gate is the last
    extension); the ids whose compilation failed."""
    released = gate.release()
    for new in released.ready:
        scheduler.add_request(new.request)
    return released.failed


def test_the_gate_admits_a_request_once_its_grammar_is_ready() -> None:
    """A held request is unknown to the scheduler until its compilation completes; then its samples get the
    grammar and the scheduler the request. An unconstrained request passes the gate."""
    scheduler = Scheduler(SchedulerConfig(max_model_len=64, watermark=0.0), BlockManager(32, 4))
    grammar: Future[xgr.CompiledGrammar] = Future()
    gate = gate_of(grammar)
    started: list[xgr.CompiledGrammar] = []
    request = Request("g", list(PROMPT), _scheduler_params())
    assert not gate.hold(
        NewRequest(cast(EngineRequest, None), Request("p", list(PROMPT), _scheduler_params()), None)
    )
    held(gate, request, started.append)
    assert admit_ready(gate, scheduler) == [] and len(gate) == 1 and gate.num_held() == 1
    assert scheduler.get_request("g") is None and not started
    assert gate.wait(0.01)  # a held grammar: the idle poll waits (here for nothing)
    compiled = cast(xgr.CompiledGrammar, object())
    grammar.set_result(compiled)
    assert admit_ready(gate, scheduler) == []
    assert started == [compiled] and scheduler.get_request("g") is not None and len(gate) == 0
    assert not gate.wait(10.0)  # nothing held: no wait at all


def test_the_gate_reports_a_failed_compilation_and_cancels_on_abort(caplog: pytest.LogCaptureFixture) -> None:
    """A compilation that raised is reported (logged) and the request no longer held; `done` (an abort) stops the
    wait."""
    scheduler = Scheduler(SchedulerConfig(max_model_len=64, watermark=0.0), BlockManager(32, 4))
    failing: Future[xgr.CompiledGrammar] = Future()
    pending: Future[xgr.CompiledGrammar] = Future()
    gate = gate_of(failing, pending)
    held(gate, Request("bad", list(PROMPT), _scheduler_params()), lambda _: None)
    held(gate, Request("slow", list(PROMPT), _scheduler_params()), lambda _: None)
    failing.set_exception(RuntimeError("no grammar"))
    with caplog.at_level(logging.ERROR):
        assert admit_ready(gate, scheduler) == ["bad"]
    assert "request bad: its grammar could not be compiled or admitted" in caplog.text
    assert len(gate) == 1 and scheduler.get_request("bad") is None
    gate.done("slow")
    gate.done("unknown")  # ignored
    assert pending.cancelled() and len(gate) == 0


def test_the_engine_counts_held_requests_as_waiting_and_aborts_them(
    tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While its grammar compiles a request waits (get_stats), steps do not spin, an abort cancels it, a failed
    compilation aborts it, and a compiled grammar admits it."""
    engine = make_engine(tokenizer)
    constraint = StructuredOutputsParams(regex="[a-z]+")
    compiled = engine.structured.compile(constraint).result(timeout=120)
    futures: list[Future[xgr.CompiledGrammar]] = []

    def compile_later(params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        futures.append(Future())
        return futures[-1]

    monkeypatch.setattr(engine.structured, "compile", compile_later)
    params = SamplingParams(max_tokens=6, structured_outputs=constraint)
    for request_id in ("aborted", "failed", "admitted"):
        engine.add_request(request_id, PROMPT, params)
    assert engine.step() == []
    stats = engine.get_stats()
    assert (stats.num_waiting, stats.num_running, engine.get_num_unfinished_requests()) == (3, 0, 3)
    engine.abort_request("aborted")
    assert futures[0].cancelled()
    futures[1].set_exception(RuntimeError("no grammar"))
    futures[2].set_result(compiled)
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs["aborted"].finished and outputs["aborted"].outputs[0].finish_reason == "abort"
    assert outputs["failed"].finished and outputs["failed"].outputs[0].finish_reason == "abort"
    assert engine.get_stats().num_waiting == 0 and engine.get_num_unfinished_requests() == 1
    finished = [o for o in run(engine) if o.finished]
    assert [o.request_id for o in finished] == ["admitted"]
    assert finished[0].outputs[0].finish_reason in ("stop", "length")


def _scheduler_params() -> SchedulerParams:
    """What the scheduler reads of a 4-token request."""
    return SchedulerParams.from_params(SamplingParams(max_tokens=4), frozenset())
