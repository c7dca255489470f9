"""Multi-LoRA in the engine: greedy tokens equal transformers + PEFT (float32) on the tiny llama, qwen2 and gemma3;
two adapters and the base model served in one batch with prefix caching, chunked prefill and preemption; the prefix
cache never serves a block computed under another adapter."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from pagoda.scheduler import SchedulerOutput
from pagoda.server.beam_search import BeamSearchParams
from pagoda.server.llm import LLM
from pagoda.server.lora import LoRAError, LoRARequest
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import make_tiny_model
from pagoda.server.testing.tiny_lora import greedy, make_tiny_lora, peft_reference
from transformers import AutoModelForCausalLM, PreTrainedModel

pytest.importorskip("peft")

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ARCHS = ("llama", "qwen2", "gemma3")


def prompts(lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths (clear of the special ids)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


class Setup:
    """A tiny base model, two adapters on it and their references (computed lazily, cached)."""

    def __init__(self, root: Path, arch: str) -> None:
        self.base = make_tiny_model(arch, root / "base")
        # Adapter a adapts every projection; b only some (q, v and down: fused shards left without factors).
        self.a = make_tiny_lora(self.base, root / "a", rank=8, seed=1)
        self.b = make_tiny_lora(
            self.base, root / "b", rank=4, seed=2, target_modules=("q_proj", "v_proj", "down_proj")
        )
        self._models: dict[str, PreTrainedModel] = {}
        self._cache: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def request(self, which: str) -> LoRARequest:
        """The LoRARequest of adapter `which` ("a" or "b")."""
        return LoRARequest(which, 1 if which == "a" else 2, str(self.a if which == "a" else self.b))

    def reference(self, which: str | None, prompt: Sequence[int]) -> list[int]:
        """Greedy tokens of transformers (+ PEFT for an adapter) for one prompt alone."""
        key = (which or "base", tuple(prompt))
        if key not in self._cache:
            if key[0] not in self._models:
                if which is None:
                    model = AutoModelForCausalLM.from_pretrained(
                        self.base, attn_implementation="eager", dtype=torch.float32
                    )
                    self._models["base"] = model
                else:
                    self._models[which] = peft_reference(self.base, self.a if which == "a" else self.b)
            self._cache[key] = greedy(self._models[key[0]], prompt, MAX_TOKENS)
        return self._cache[key]


@pytest.fixture(scope="module")
def setups(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Setup]:
    """One Setup per architecture."""
    root = tmp_path_factory.mktemp("lora-engine")
    return {arch: Setup(root / arch, arch) for arch in ARCHS}


def make_llm(base: Path, **kwargs: Any) -> LLM:
    """A float32 LoRA engine on a tiny model with 4-token blocks."""
    args: dict[str, Any] = {
        "block_size": 4,
        "num_kv_blocks": 256,
        "max_model_len": 64,
        "dtype": "float32",
        "enable_lora": True,
        "max_loras": 2,
    }
    args.update(kwargs)
    return LLM(str(base), **args)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_peft(arch: str, setups: dict[str, Setup]) -> None:
    """Each adapter alone gives transformers + PEFT's greedy tokens, which differ from the base model's."""
    setup = setups[arch]
    llm = make_llm(setup.base)
    prompt = prompts([11], seed=3)[0]
    for which in ("a", "b"):
        out = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=setup.request(which))
        assert list(out[0].outputs[0].token_ids) == setup.reference(which, prompt), which
        assert setup.reference(which, prompt) != setup.reference(None, prompt), (
            f"adapter {which} changes nothing"
        )
    base = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert list(base[0].outputs[0].token_ids) == setup.reference(None, prompt)


class Recorder:
    """Wraps an engine's schedule: the steps it planned, to assert what a batch mixed."""

    def __init__(self, llm: LLM) -> None:
        self.steps: list[SchedulerOutput] = []
        self._schedule = llm.engine.scheduler.schedule
        llm.engine.scheduler.schedule = self  # type: ignore[method-assign]

    def __call__(self) -> SchedulerOutput:
        """Plan the step and keep it."""
        out = self._schedule()
        self.steps.append(out)
        return out


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_two_adapters_and_the_base_in_one_batch(arch: str, setups: dict[str, Setup]) -> None:
    """Requests for a, b and the base (sharing a prompt prefix) run together with chunked prefill, prefix caching
    and a pool small enough to preempt, and each gets the tokens it gets alone."""
    setup = setups[arch]
    # One block table for all layers: KV cache groups would give gemma3's window layers room enough not to preempt.
    llm = make_llm(
        setup.base,
        num_kv_blocks=24,
        max_model_len=40,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        disable_hybrid_kv_cache_manager=True,
    )
    recorder = Recorder(llm)
    shared = prompts([12], seed=5)[0]
    tails = prompts([8, 10, 6, 9, 7, 11], seed=6)
    batch = [shared + tail for tail in tails]
    loras: list[LoRARequest | None] = [setup.request("a"), setup.request("b"), None] * 2
    outs = llm.generate(batch, GREEDY, use_tqdm=False, lora_request=loras)
    for out, prompt, lora in zip(outs, batch, loras, strict=True):
        which = None if lora is None else lora.lora_name
        assert list(out.outputs[0].token_ids) == setup.reference(which, prompt), which
    mixed = [{c.lora_id for c in step.scheduled} for step in recorder.steps]
    assert any(ids == {1, 2, None} for ids in mixed), "no step mixed both adapters and the base"
    assert any(step.preempted_request_ids for step in recorder.steps), "the pool did not preempt"
    assert any(c.num_tokens > 1 and c.num_samples == 0 for s in recorder.steps for c in s.scheduled), (
        "no chunking"
    )


def test_prefix_cache_is_keyed_by_adapter(setups: dict[str, Setup]) -> None:
    """A prompt computed under a is never served to b or the base from the cache, and is served to a again."""
    setup = setups["llama"]
    llm = make_llm(setup.base, enable_prefix_caching=True)
    prompt = prompts([17], seed=7)[0]
    first = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=setup.request("a"))[0]
    assert first.num_cached_tokens == 0
    under_b = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=setup.request("b"))[0]
    assert under_b.num_cached_tokens == 0
    assert list(under_b.outputs[0].token_ids) == setup.reference("b", prompt)
    base = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert base.num_cached_tokens == 0
    again = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=setup.request("a"))[0]
    assert again.num_cached_tokens >= 16
    assert list(again.outputs[0].token_ids) == setup.reference("a", prompt)


def test_lora_request_without_enable_lora_is_refused(setups: dict[str, Setup]) -> None:
    """An adapter on an engine without LoRA is an error naming `model`."""
    llm = make_llm(setups["llama"].base, enable_lora=False, max_loras=None)
    with pytest.raises(LoRAError) as info:
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=setups["llama"].request("a"))
    assert info.value.param == "model"


def test_every_way_a_request_ends_unpins_its_adapter(setups: dict[str, Setup]) -> None:
    """Finished, aborted mid-run (a plain request and a beam search, which reports no snapshot of its own) or
    refused by the scheduler after its adapter was pinned: the adapter's pin goes with the request."""
    setup = setups["llama"]
    llm = make_llm(setup.base, max_loras=2)
    engine = llm.engine
    lora = engine.lora
    assert lora is not None
    adapter = setup.request("a")
    llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=adapter)
    beams = SamplingParams.for_beam_search(BeamSearchParams(2, 8, ignore_eos=True), n=1)
    engine.add_request(
        "plain", [5, 6, 7, 8], SamplingParams(max_tokens=8, ignore_eos=True), lora_request=adapter
    )
    engine.add_request("beams", [5, 6, 7, 9], beams, lora_request=adapter)
    assert lora.manager.pins[adapter.lora_int_id] == 2
    engine.step()
    engine.abort_request("plain")
    engine.abort_request("beams")
    engine.step()
    too_many = SamplingParams(n=engine.scheduler.config.max_num_seqs + 1, max_tokens=4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.add_request("refused", [5, 6, 7], too_many, lora_request=adapter)
    assert not engine.has_unfinished_requests()
    assert dict(lora.manager.pins) == {}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tp2_with_adapters_equals_tp1(arch: str, setups: dict[str, Setup]) -> None:
    """Two ranks (q/k/v and gate/up B split by rows, o and down A by columns, as the base weights) give TP=1's
    tokens for a batch mixing both adapters and the base, in two rounds (the worker reads them at first use)."""
    setup = setups[arch]
    batch = prompts([9, 13, 7, 11], seed=8)
    loras = [setup.request("a"), setup.request("b"), None, setup.request("a")]
    tp1 = make_llm(setup.base)
    want = [
        list(o.outputs[0].token_ids) for o in tp1.generate(batch, GREEDY, use_tqdm=False, lora_request=loras)
    ]
    tp2 = make_llm(setup.base, tensor_parallel_size=2)
    try:
        for _ in range(2):
            outs = tp2.generate(batch, GREEDY, use_tqdm=False, lora_request=loras)
            assert [list(o.outputs[0].token_ids) for o in outs] == want
    finally:
        tp2.engine.close()
    assert want[0] == setup.reference("a", batch[0]) and want[2] == setup.reference(None, batch[2])


def test_one_slot_and_one_cached_adapter_still_serve_every_adapter(setups: dict[str, Setup]) -> None:
    """max_loras=1, max_cpu_loras=1: a batch for a, b and the base runs one adapter per step; an adapter evicted
    from the CPU cache is read again on the loader thread (never the engine's) while its requests wait."""
    setup = setups["llama"]
    llm = make_llm(setup.base, max_loras=1, max_cpu_loras=1)
    recorder = Recorder(llm)
    manager = None if llm.engine.lora is None else llm.engine.lora.manager
    assert manager is not None
    readers: list[str] = []
    load = manager.load

    def spy(request: LoRARequest) -> Any:
        readers.append(threading.current_thread().name)
        return load(request)

    manager.load = spy  # type: ignore[method-assign]
    batch = prompts([9, 12, 7, 10], seed=9)
    loras = [setup.request("a"), setup.request("b"), None, setup.request("a")]
    outs = llm.generate(batch, GREEDY, use_tqdm=False, lora_request=loras)
    for out, prompt, lora in zip(outs, batch, loras, strict=True):
        assert list(out.outputs[0].token_ids) == setup.reference(
            None if lora is None else lora.lora_name, prompt
        )
    assert all(len({c.lora_id for c in s.scheduled if c.lora_id is not None}) <= 1 for s in recorder.steps)
    assert len(manager.adapters) <= 1 + len(manager.pins)
    # generate read both adapters up front (the caller's thread); the evicted one was read again off the engine
    background = [name for name in readers if name.startswith("pagoda-lora-load")]
    assert background, readers


@pytest.mark.parametrize("kernel_backend", ["torch", "cpu"])
def test_prompt_chunks_equal_peft_through_the_c_op_or_matmul_groups(
    kernel_backend: str, setups: dict[str, Setup]
) -> None:
    """Prompt-length chunks of adapter rows go through the C layer op at any row count on the CPU (no per-slot
    matmul groups), or, without it (the torch backend), through the matmul groups: PEFT's tokens either way."""
    setup = setups["llama"]
    llm = make_llm(setup.base, kernel_backend=kernel_backend)
    assert llm.engine.lora is not None
    assert llm.engine.lora.manager.group_long_chunks == (kernel_backend == "torch")
    batch = prompts([20, 24, 18], seed=8)
    loras = [setup.request("a"), setup.request("b"), setup.request("a")]
    outs = llm.generate(batch, GREEDY, use_tqdm=False, lora_request=loras)
    for out, prompt, lora in zip(outs, batch, loras, strict=True):
        assert list(out.outputs[0].token_ids) == setup.reference(lora.lora_name, prompt), lora.lora_name
