"""The engine's two seams without a model: an `EngineExtension` sees its hooks at the documented points of the step
loop (a gate that holds, releases, refuses; before execution; after the update; a request's end), and the request
contract is small, stub-free and resolved into capabilities once."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from pathlib import Path

import pytest
from pagoda.scheduler import Scheduler, SchedulerOutput
from pagoda.server.beam_search import BeamSearchParams
from pagoda.server.engine import LLMEngine, RequestRejectedError
from pagoda.server.engine.beams import BeamGroup
from pagoda.server.engine.extension import EngineExtension, Extension, Released
from pagoda.server.engine.owners import RequestOwners
from pagoda.server.engine.request_factory import NewRequest
from pagoda.server.engine.requests import RequestState
from pagoda.server.engine.step_sampler import SampledStep
from pagoda.server.lora import LoRARequest
from pagoda.server.outputs import RequestOutput
from pagoda.server.pooling.params import PoolingParams
from pagoda.server.pooling.request import PoolingRequest
from pagoda.server.request_contract import (
    EngineRequest,
    SamplesTokens,
    ScoresPrompt,
    TakesHiddenStates,
    TakesLogprobRows,
)
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.spec.request import SpeculativeRequest
from test_engine_requests import MAX_TOKENS, PROMPT, FakeModel, greedy_path, make_engine, run
from transformers import PreTrainedTokenizerBase

SERVER_SRC = Path(__file__).resolve().parents[2] / "packages" / "server" / "src" / "pagoda" / "server"
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


class Recorder(Extension):
    """Holds requests whose id starts with 'held' until `open` is set; records every hook with what it saw."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.calls: list[str] = []
        self.held: list[NewRequest] = []
        self.open = False

    def hold(self, new: NewRequest) -> bool:
        self.calls.append(f"hold {new.request.request_id}")
        if new.request.request_id.startswith("held"):
            self.held.append(new)
            return True
        return False

    def release(self) -> Released:
        if not self.open:
            return Released()
        ready, self.held = self.held, []
        return Released(ready=ready)

    def num_held(self) -> int:
        return len(self.held)

    def before_execute(self, scheduled: SchedulerOutput) -> None:
        executor = self.engine.executor
        assert isinstance(executor, FakeModel)
        # The model has not run this step: the executor has seen one step fewer than the scheduler made.
        self.calls.append(f"before {len(executor.steps)} {[c.request_id for c in scheduled.scheduled]}")

    def after_update(self, scheduler: Scheduler, sampled: SampledStep, now: float) -> None:
        self.calls.append(f"after {[seq_id for seq_id, _, _ in sampled.drawn]}")

    def done(self, request_id: str) -> None:
        self.calls.append(f"done {request_id}")


def with_recorder(engine: LLMEngine) -> Recorder:
    """Put a recorder first in the engine's extensions (the first gate a request meets)."""
    recorder = Recorder(engine)
    engine.extensions.insert(0, recorder)
    return recorder


def test_an_extension_sees_its_hooks_in_step_order(tokenizer: PreTrainedTokenizerBase) -> None:
    """A held request is unknown to the scheduler and counted as waiting until released; before_execute runs
    before the forward pass with the scheduled chunks, after_update after the update with the drawn rows, and done
    once per request; the tokens are those of an engine without the extension."""
    engine = make_engine(tokenizer)
    recorder = with_recorder(engine)
    engine.add_request("plain", PROMPT, PARAMS)
    engine.add_request("held", PROMPT, PARAMS)
    assert recorder.calls == ["hold plain", "hold held"]
    assert engine.scheduler.get_request("held") is None and engine.get_stats().num_waiting == 2
    first = engine.step()
    assert [o.request_id for o in first] == ["plain"]
    assert recorder.calls[2:] == ["before 0 ['plain']", "after ['plain']"]
    assert engine.get_stats().num_waiting == 1  # the held one
    recorder.open = True
    outputs = first + [o for o in run(engine)]
    for request_id in ("plain", "held"):
        final = [o for o in outputs if o.request_id == request_id][-1]
        assert final.finished and list(final.outputs[0].token_ids) == greedy_path(len(PROMPT), MAX_TOKENS)
    assert recorder.calls.count("done plain") == 1 and recorder.calls.count("done held") == 1
    befores = [c for c in recorder.calls if c.startswith("before")]
    afters = [c for c in recorder.calls if c.startswith("after")]
    executor = engine.executor
    assert isinstance(executor, FakeModel)
    assert len(befores) == len(afters) == len(executor.steps)
    assert [int(c.split()[1]) for c in befores] == list(range(len(executor.steps)))


def test_an_abort_reaches_every_extension_even_while_held(tokenizer: PreTrainedTokenizerBase) -> None:
    """Aborting a held request tells the extensions (`done`), reports its final snapshot and frees nothing in the
    scheduler, which never saw it."""
    engine = make_engine(tokenizer)
    recorder = with_recorder(engine)
    engine.add_request("held", PROMPT, PARAMS)
    engine.abort_request("held")
    assert "done held" in recorder.calls
    (final,) = engine.step()
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests() and not engine.owners.seqs


class Refuser(Extension):
    """A gate that refuses every request, naming a field."""

    def hold(self, new: NewRequest) -> bool:
        raise RequestRejectedError("refused by the test gate", "prompt")


def test_a_gate_that_refuses_rejects_the_request_and_every_extension_drops_it(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """A refusal after an earlier gate passed the request: RequestRejectedError reaches the caller with its field,
    every extension is told the request is done (an earlier gate's pin is released), and nothing is registered."""
    engine = make_engine(tokenizer)
    recorder = with_recorder(engine)
    engine.extensions.insert(1, Refuser())
    with pytest.raises(RequestRejectedError, match="refused by the test gate") as caught:
        engine.add_request("x", PROMPT, PARAMS)
    assert caught.value.param == "prompt"
    assert recorder.calls == ["hold x", "done x"]
    assert not engine.has_unfinished_requests() and engine.scheduler.get_request("x") is None


def test_a_released_request_the_next_gate_refuses_is_aborted_and_logged(
    tokenizer: PreTrainedTokenizerBase, caplog: pytest.LogCaptureFixture
) -> None:
    """A request released by one gate goes on to the next; if that one refuses it, it is aborted and logged (its
    final snapshot goes out), every extension drops it, and the engine goes on."""
    engine = make_engine(tokenizer)
    recorder = with_recorder(engine)
    engine.add_request("held", PROMPT, PARAMS)
    engine.add_request("plain", PROMPT, PARAMS)
    engine.extensions.insert(1, Refuser())  # after admission: only the released request meets it
    recorder.open = True
    outputs = engine.step()
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outputs if o.request_id == "held"] == [
        ("held", "abort")
    ]
    assert "request held could not be admitted" in caplog.text
    assert "done held" in recorder.calls and "held" not in engine.owners.requests
    finished = [o for o in run(engine) if o.finished]
    assert [o.request_id for o in finished] == ["plain"]


def test_every_engine_extension_follows_the_protocol(tokenizer: PreTrainedTokenizerBase) -> None:
    """The engine's own extensions (the LoRA refusal, the grammar gate, drafting) are EngineExtensions."""
    engine = make_engine(tokenizer)
    extensions: list[EngineExtension] = engine.extensions
    assert [type(e).__name__ for e in extensions] == ["NoLoRA", "GrammarGate", "Drafting"]
    with pytest.raises(RequestRejectedError, match="enable_lora"):
        engine.add_request("l", PROMPT, PARAMS, lora_request=LoRARequest("a", 1, "/nowhere"))


def test_step_and_update_name_no_feature() -> None:
    """The step loop's methods name no feature: every feature is a request capability or an extension."""
    features = re.compile(r"lora|draft|grammar|gate|beam|pool|spec|struct|adapter|embed", re.IGNORECASE)
    for method in (
        LLMEngine.step,
        LLMEngine._update,
        LLMEngine._idle,
        LLMEngine._release_held,
        LLMEngine._pass_on,
    ):
        (function,) = ast.parse(textwrap.dedent(inspect.getsource(method))).body
        assert isinstance(function, ast.FunctionDef)
        function.body = function.body[1:]  # the docstring (prose; unparsing drops the comments too)
        code = ast.unparse(function)
        assert not features.findall(code), (method.__name__, features.findall(code))


def test_the_request_contract_is_small() -> None:
    """EngineRequest has at most 8 members; the row capabilities add only what their rows need."""

    def members(protocol: type) -> set[str]:
        own = {name for name in vars(protocol) if not name.startswith("_")}
        return own

    assert len(members(EngineRequest)) <= 8
    assert members(SamplesTokens) == {"draw_spec", "add_token", "finish_as_scheduled"}
    assert members(TakesLogprobRows) == {"add_logprob_row"}


def test_each_request_type_has_exactly_the_capabilities_it_uses(tokenizer: PreTrainedTokenizerBase) -> None:
    """Plain and speculative requests sample and score prompts; beams and pooling take rows; pooling takes hidden
    states; none of them has a member it does not use."""
    engine = make_engine(tokenizer)
    plain = RequestState("p", None, PROMPT, PARAMS, (), tokenizer, 0.0, 0)
    speculative = SpeculativeRequest(plain, lambda: pytest.fail("no proposer needed"), lambda s, a: 0)
    engine.add_request("b", PROMPT, SamplingParams.for_beam_search(BeamSearchParams(2, MAX_TOKENS), n=1))
    beams = engine.owners.requests["b"]
    pooling = PoolingRequest("e", None, PROMPT, PoolingParams(), 0.0)
    capabilities = (SamplesTokens, TakesLogprobRows, ScoresPrompt, TakesHiddenStates)

    def has(request: object) -> list[str]:
        return [c.__name__ for c in capabilities if isinstance(request, c)]

    assert has(plain) == has(speculative) == ["SamplesTokens", "ScoresPrompt"]
    assert isinstance(beams, BeamGroup) and has(beams) == ["TakesLogprobRows"]
    assert has(pooling) == ["TakesLogprobRows", "TakesHiddenStates"]
    for request in (plain, speculative, beams, pooling):
        assert isinstance(request, EngineRequest)


def test_no_request_type_carries_a_stub() -> None:
    """No module of the server says a method is never called (the old contract's stubs)."""
    stubs = [str(p) for p in SERVER_SRC.rglob("*.py") if "Never called" in p.read_text()]
    assert stubs == []


def test_an_owner_without_a_row_capability_is_refused() -> None:
    """A request that neither samples nor takes logprob rows cannot be registered."""

    class Mute:
        request_id = "m"
        seq_ids = ("m",)
        finished = False

        def mark_scheduled(self, num_computed_tokens: int, now: float) -> None: ...
        def end_step(self, scheduler: Scheduler) -> bool:
            return False

        def snapshot(self) -> RequestOutput:
            raise AssertionError

        def abort(self) -> RequestOutput | None:
            return None

    owners = RequestOwners()
    with pytest.raises(TypeError, match="neither samples tokens nor takes logprob rows"):
        owners.own(Mute(), 3)
    assert not owners.requests and not owners.seqs
