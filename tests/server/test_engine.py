"""The engine against Hugging Face transformers' greedy `generate`, token for token, on tiny random models."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple, cast

import pytest
import torch
from pagoda.scheduler import MeasuredPreemptionCosts, SchedulerOutput, StaticBatchPolicy
from pagoda.scheduler.testing import ThresholdPreemptionCosts
from pagoda.server.engine import EngineConfigError, LLMEngine, RequestRejectedError
from pagoda.server.llm import LLM
from pagoda.server.outputs import RequestOutput
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import ARCHS, dense_copy, make_tiny_model
from transformers import AutoModelForCausalLM, PreTrainedModel

PROMPT_LENS = (5, 9, 17, 30, 3)  # cross block boundaries of 4, one shorter than a block
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def random_prompts(lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths (ids clear of the special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny random-weight model folder per architecture."""
    root = tmp_path_factory.mktemp("engine-models")
    return {arch: make_tiny_model(arch, root / arch) for arch in ARCHS}


class Reference:
    """Hugging Face greedy generations, computed once per (arch, prompt)."""

    def __init__(self, model_dirs: dict[str, Path]) -> None:
        self.model_dirs = model_dirs
        self._models: dict[str, PreTrainedModel] = {}
        self._cache: dict[tuple[str, tuple[int, ...], int], list[int]] = {}

    def model(self, arch: str) -> PreTrainedModel:
        """The HF model of an architecture, float32, eval mode."""
        if arch not in self._models:
            model = AutoModelForCausalLM.from_pretrained(self.model_dirs[arch], dtype=torch.float32)
            self._models[arch] = cast(PreTrainedModel, model).requires_grad_(False)
        return self._models[arch]

    def greedy(self, arch: str, prompt: Sequence[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        """Tokens HF's greedy generate produces for one prompt alone."""
        key = (arch, tuple(prompt), max_tokens)
        if key not in self._cache:
            out = cast(Any, self.model(arch)).generate(
                torch.tensor([list(prompt)]),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            self._cache[key] = out[0, len(prompt) :].tolist()
        return self._cache[key]

    def logits(self, arch: str, tokens: Sequence[int]) -> torch.Tensor:  # [len(tokens), vocab]
        """HF's logits for every position of a token sequence."""
        with torch.no_grad():
            out = cast(Any, self.model(arch))(torch.tensor([list(tokens)]))
        logits: torch.Tensor = out.logits[0].float()
        return logits


@pytest.fixture(scope="module")
def reference(model_dirs: dict[str, Path]) -> Reference:
    """Shared HF reference for the module."""
    return Reference(model_dirs)


def make_llm(model_dir: Path, **kwargs: Any) -> LLM:
    """An LLM on a tiny model with block size 4 and a small pool unless overridden, in float32 like the reference."""
    args: dict[str, Any] = {"block_size": 4, "num_kv_blocks": 256, "max_model_len": 64, "dtype": "float32"}
    args.update(kwargs)
    return LLM(str(model_dir), **args)


# Six prompts that a 24-block pool of 4-token blocks cannot hold at once: the batch preempts.
PREEMPTING_PROMPT_LENS = (20, 22, 18, 25, 21, 19)


def preempting_llm(model_dir: Path, mode: str) -> LLM:
    """An LLM whose KV pool is too small for PREEMPTING_PROMPT_LENS, preempting by `mode` (recompute or swap)."""
    return make_llm(model_dir, num_kv_blocks=24, max_model_len=40, preemption_mode=mode, swap_space_gib=0.01)


class StepSpy:
    """Wraps the engine's `scheduler.schedule`: keeps every SchedulerOutput and how each victim was preempted."""

    def __init__(self, llm: LLM) -> None:
        self.steps: list[SchedulerOutput] = []
        self.swaps = 0  # preemptions that moved the victim's blocks to the host tier
        self.recomputes = 0
        scheduler = llm.engine.scheduler
        schedule = scheduler.schedule

        def spy() -> SchedulerOutput:
            out = schedule()
            self.steps.append(out)
            swapped = {r.request_id for r in scheduler.swapped}
            for rid in out.preempted_request_ids:
                if rid in swapped:
                    self.swaps += 1
                else:
                    self.recomputes += 1
            return out

        scheduler.schedule = spy  # type: ignore[method-assign]

    @property
    def num_split_prefills(self) -> int:
        """Chunks that ended mid-prompt (they sample nothing): the prefills that were split over steps."""
        return sum(1 for out in self.steps for c in out.scheduled if not c.num_samples)


def tokens(outputs: Sequence[RequestOutput], index: int = 0) -> list[list[int]]:
    """Generated token ids of sample `index` of each output."""
    return [list(o.outputs[index].token_ids) for o in outputs]


def assert_matches(
    reference: Reference, arch: str, prompts: Sequence[Sequence[int]], got: list[list[int]]
) -> None:
    """Every generation equals HF's greedy generation of that prompt alone."""
    for prompt, generated in zip(prompts, got, strict=True):
        assert generated == reference.greedy(arch, prompt), f"prompt of {len(prompt)} tokens"


def drain(engine: LLMEngine) -> Iterator[RequestOutput]:
    """Step until idle, yielding every snapshot."""
    while engine.has_unfinished_requests():
        yield from engine.step()


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_batch_matches_transformers(
    arch: str, backend: str, model_dirs: dict[str, Path], reference: Reference
) -> None:
    """A batch of prompts of different lengths equals HF's greedy generate of each prompt alone, with the default
    kernels (the C kernel of the cpu backend: every other engine test runs on it too) and the torch reference."""
    prompts = random_prompts(PROMPT_LENS)
    llm = make_llm(model_dirs[arch], kernel_backend=backend)
    assert llm.engine.runner.backend.name == ("cpu" if backend == "auto" else backend)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches(reference, arch, prompts, tokens(outputs))
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert llm.engine.kv_manager.stats().num_used_blocks == 0


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_preemption_is_exact(arch: str, mode: str, model_dirs: dict[str, Path], reference: Reference) -> None:
    """A pool too small for the batch preempts (recompute, swap, or auto's choice) and still produces HF's
    tokens; the forced modes really preempt the way they say."""
    prompts = random_prompts(PREEMPTING_PROMPT_LENS, seed=1)
    llm = preempting_llm(model_dirs[arch], mode)
    spy = StepSpy(llm)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.get_stats().num_preemptions == spy.swaps + spy.recomputes > 0
    if mode == "recompute":
        assert spy.swaps == 0
    if mode == "swap":
        assert spy.swaps > 0 and any(out.blocks_to_swap_in for out in spy.steps)
    assert_matches(reference, arch, prompts, tokens(outputs))
    assert llm.engine.kv_manager.stats().num_used_blocks == 0


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_uninitialised_cache_memory_never_reaches_the_output(
    arch: str, model_dirs: dict[str, Path], reference: Reference
) -> None:
    """The caches are allocated uninitialised: NaN in every device and host slot, then swapping, changes nothing."""
    prompts = random_prompts(PREEMPTING_PROMPT_LENS, seed=1)
    llm = preempting_llm(model_dirs[arch], "swap")
    cache = llm.engine.runner.kv_cache
    for k, v in [*cache.device_caches, *cache.host_caches]:
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    spy = StepSpy(llm)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert spy.swaps > 0 and any(out.blocks_to_swap_in for out in spy.steps)
    assert_matches(reference, arch, prompts, tokens(outputs))


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_prefix_caching_is_exact(arch: str, model_dirs: dict[str, Path], reference: Reference) -> None:
    """A second batch sharing a long prefix with the first hits the cache, reports it, and stays exact."""
    shared = random_prompts((24,), seed=2)[0]
    first = [shared + tail for tail in random_prompts((3, 5), seed=3)]
    second = [shared + tail for tail in random_prompts((4, 7, 2), seed=4)]
    llm = make_llm(model_dirs[arch])
    assert_matches(reference, arch, first, tokens(llm.generate(first, GREEDY, use_tqdm=False)))
    outputs = llm.generate(second, GREEDY, use_tqdm=False)
    assert_matches(reference, arch, second, tokens(outputs))
    assert all(o.num_cached_tokens == 24 for o in outputs)  # 6 full blocks of 4
    assert llm.engine.get_stats().prefix_cache_hits >= 3 * 24


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_chunked_prefill_is_exact(arch: str, model_dirs: dict[str, Path], reference: Reference) -> None:
    """A token budget of 16 splits the long prompts over steps; output unchanged."""
    prompts = random_prompts(PROMPT_LENS)
    llm = make_llm(model_dirs[arch], max_num_batched_tokens=16)
    spy = StepSpy(llm)
    assert_matches(reference, arch, prompts, tokens(llm.generate(prompts, GREEDY, use_tqdm=False)))
    assert spy.num_split_prefills > 0


def test_chunked_prefill_knobs_are_exact(model_dirs: dict[str, Path], reference: Reference) -> None:
    """A prefill budget of 8 (TGI's), one partial prefill at a time and a per-request cap of 6: the prompts
    are split and taken one at a time, and the tokens do not change."""
    prompts = random_prompts(PROMPT_LENS)
    llm = make_llm(
        model_dirs["llama"],
        max_batch_prefill_tokens=8,
        max_num_partial_prefills=1,
        long_prefill_token_threshold=6,
    )
    spy = StepSpy(llm)
    assert_matches(reference, "llama", prompts, tokens(llm.generate(prompts, GREEDY, use_tqdm=False)))
    prefill_chunks = [
        [c for c in out.scheduled if c.num_tokens > 1 or not c.num_samples] for out in spy.steps
    ]
    assert spy.num_split_prefills > 0 and max(len(chunks) for chunks in prefill_chunks) == 1
    assert max(c.num_tokens for chunks in prefill_chunks for c in chunks) == 6


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_auto_preemption_swaps_long_victims_and_recomputes_short_ones_exactly(
    arch: str, model_dirs: dict[str, Path], reference: Reference
) -> None:
    """The engine measures its costs at start; on a forced cost model both mechanisms run in one batch, and
    the greedy tokens are still HF's."""
    llm = preempting_llm(model_dirs[arch], "auto")
    measured = llm.engine.scheduler.preemption_costs
    assert isinstance(measured, MeasuredPreemptionCosts)
    assert measured.prefill_tokens_per_s > 0 and measured.host_copy_bytes_per_s > 0
    assert 0 <= measured.host_copy_latency_s < 1
    # With these lengths the victims hold 2 and 8 blocks: one of each kind.
    llm.engine.scheduler.preemption_costs = ThresholdPreemptionCosts(min_swap_blocks=5)
    spy = StepSpy(llm)
    prompts = random_prompts((20, 22, 4, 25, 5, 21, 3), seed=1)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert spy.swaps > 0 and spy.recomputes > 0
    assert_matches(reference, arch, prompts, tokens(outputs))
    assert llm.engine.kv_manager.stats().num_used_blocks == 0


def test_urgent_request_preempts_a_less_urgent_one_and_finishes_first(
    model_dirs: dict[str, Path], reference: Reference
) -> None:
    """Priority policy, a full batch (2 seats) of priority-1 requests: a priority-0 request preempts the later
    of them at once, finishes first, and every output is still HF's."""
    llm = make_llm(model_dirs["llama"], scheduling_policy="priority", max_num_seqs=2)
    engine = llm.engine
    spy = StepSpy(llm)
    low_prompts = random_prompts((9, 11), seed=7)
    urgent_prompt = random_prompts((6,), seed=8)[0]
    long_params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, priority=1)
    for i, prompt in enumerate(low_prompts):
        engine.add_request(f"low{i}", prompt, long_params, arrival_time=float(i))
    for _ in range(3):
        engine.step()
    urgent_params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, priority=0)
    engine.add_request("urgent", urgent_prompt, urgent_params, arrival_time=2.0)
    engine.step()
    assert spy.steps[-1].preempted_request_ids == ("low1",)
    assert "urgent" in {c.request_id for c in spy.steps[-1].scheduled}
    finished = [o for o in drain(engine) if o.finished]
    assert finished[0].request_id == "urgent"
    got = {o.request_id: list(o.outputs[0].token_ids) for o in finished}
    assert got["urgent"] == reference.greedy("llama", urgent_prompt, 6)
    for i, prompt in enumerate(low_prompts):
        assert got[f"low{i}"] == reference.greedy("llama", prompt, 30)


def test_parallel_greedy_samples_are_equal(model_dirs: dict[str, Path], reference: Reference) -> None:
    """n = 2 greedy: both samples (forked, copy-on-write) equal the single sample."""
    prompts = random_prompts((9, 14))
    llm = make_llm(model_dirs["llama"])
    outputs = llm.generate(
        prompts, SamplingParams(n=2, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    )
    assert_matches(reference, "llama", prompts, tokens(outputs, 0))
    assert_matches(reference, "llama", prompts, tokens(outputs, 1))
    assert [o.outputs[1].index for o in outputs] == [1, 1]


def test_triton_backend_is_exact(model_dirs: dict[str, Path], reference: Reference) -> None:
    """The Triton kernels (interpreted on the CPU) give the same tokens.

    Runs in a subprocess: Triton decides at import whether kernels are interpreted, so TRITON_INTERPRET must be
    set before anything in the process imports it.
    """
    prompts = random_prompts((5, 9))
    code = (
        "import json, sys\n"
        "from pagoda.server.llm import LLM\n"
        "from pagoda.server.sampling_params import SamplingParams\n"
        "llm = LLM(sys.argv[1], block_size=4, num_kv_blocks=64, max_model_len=64, kernel_backend='triton', dtype='float32')\n"
        "assert llm.engine.runner.backend.name == 'triton'\n"
        "params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)\n"
        "outs = llm.generate(json.loads(sys.argv[2]), params, use_tqdm=False)\n"
        "print(json.dumps([list(o.outputs[0].token_ids) for o in outs]))\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code, str(model_dirs["llama"]), json.dumps(prompts)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got == [reference.greedy("llama", p, 4) for p in prompts]


def test_stop_token_ids_and_max_tokens(model_dirs: dict[str, Path], reference: Reference) -> None:
    """A stop token id ends the sample (kept in token_ids, reason "stop"); max_tokens gives "length"."""
    prompt = random_prompts((9,))[0]
    expected = reference.greedy("llama", prompt)
    first = next(i for i in range(3, len(expected)) if expected.index(expected[i]) == i)
    stop_at = expected[first]
    llm = make_llm(model_dirs["llama"])
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=(stop_at,)),
        use_tqdm=False,
    )[0].outputs[0]
    assert list(out.token_ids) == expected[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_at)
    # The stop token's text is left out (vLLM): the text is that of the tokens before it.
    before = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=first), use_tqdm=False)[0]
    assert out.text == before.outputs[0].text
    short = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0].outputs[
        0
    ]
    assert list(short.token_ids) == expected[:3] and short.finish_reason == "length"


def test_stop_strings(model_dirs: dict[str, Path]) -> None:
    """The text ends before the stop string, which finishes the sample with it as stop_reason."""
    llm = make_llm(model_dirs["llama"])
    prompt = random_prompts((9,))[0]
    free = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 2]
    assert stop.strip(), free.text
    cut = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=(stop,)), use_tqdm=False
    )
    out = cut[0].outputs[0]
    assert out.text == free.text[: free.text.index(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_seed_is_independent_of_batch(model_dirs: dict[str, Path]) -> None:
    """The same seed gives the same tokens alone and inside different batches."""
    llm = make_llm(model_dirs["qwen2"])
    prompt = random_prompts((7,))[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    alone = tokens(llm.generate([prompt], seeded, use_tqdm=False))[0]
    mixed = llm.generate([*random_prompts((4, 11), seed=5), prompt], [other, other, seeded], use_tqdm=False)
    mixed_first = llm.generate([prompt, *random_prompts((13,), seed=6)], [seeded, other], use_tqdm=False)
    assert tokens(mixed)[2] == alone == tokens(mixed_first)[0]


def test_logprobs_match_transformers(model_dirs: dict[str, Path], reference: Reference) -> None:
    """Sampled-token and top-k logprobs equal log-softmax of HF's logits within 1e-4."""
    prompt = random_prompts((10,))[0]
    llm = make_llm(model_dirs["gemma3"])
    out = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    generated = list(out.token_ids)
    ref = torch.log_softmax(reference.logits("gemma3", prompt + generated[:-1]), dim=-1)[len(prompt) - 1 :]
    assert out.logprobs is not None and len(out.logprobs) == 5
    total = 0.0
    for position, (token, entry) in enumerate(zip(generated, out.logprobs, strict=True)):
        assert entry[token].rank == 1  # greedy picks the most likely token
        top = torch.topk(ref[position], 3)
        assert len(entry) == 3 and set(entry) == set(top.indices.tolist())
        for tid, lp in entry.items():
            assert math.isclose(lp.logprob, ref[position, tid].item(), abs_tol=1e-4)
        total += entry[token].logprob
    assert out.cumulative_logprob is not None and math.isclose(out.cumulative_logprob, total, abs_tol=1e-6)


def test_chat_uses_the_template(model_dirs: dict[str, Path]) -> None:
    """chat() renders the tokenizer's chat template and generates a reply."""
    llm = make_llm(model_dirs["llama"])
    messages = [{"role": "user", "content": "hello there"}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)[
        0
    ]
    rendered = llm.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert list(out.prompt_token_ids) == list(rendered)
    assert len(out.outputs[0].token_ids) == 4


def test_tokenizer_from_its_own_folder(tmp_path: Path) -> None:
    """EngineConfig.tokenizer (`--tokenizer`): the tokenizer is read from that folder; the model folder has none."""
    model = make_tiny_model("llama", tmp_path / "model")
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).rename(tokenizer_dir / name)
    # A template of its own tells this folder's tokenizer apart from the model folder's.
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    (tokenizer_dir / "tokenizer_config.json").write_text(
        json.dumps({**tokenizer_config, "chat_template": template})
    )
    llm = make_llm(model, tokenizer=str(tokenizer_dir))
    assert llm.tokenizer.chat_template == template
    assert llm.tokenizer.eos_token_id in llm.engine.eos_token_ids
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    out = llm.generate(["Hello world"], params, use_tqdm=False)[0]
    assert list(out.prompt_token_ids) == llm.tokenizer("Hello world").input_ids
    assert out.outputs[0].text == llm.tokenizer.decode(list(out.outputs[0].token_ids))


def test_abort_frees_blocks_in_every_state(model_dirs: dict[str, Path]) -> None:
    """Aborting waiting, mid-prefill and decoding requests frees their blocks and reports "abort"."""
    llm = make_llm(model_dirs["llama"], max_num_batched_tokens=8, max_num_seqs=2)
    engine = llm.engine
    for i, prompt in enumerate(random_prompts((20, 6, 6))):
        engine.add_request(f"r{i}", prompt, GREEDY)
    engine.step()  # r0 mid-prefill (8 of 20 tokens), r1/r2 waiting or partly scheduled
    engine.abort_request("r0")
    while not any(o.request_id == "r1" and o.outputs[0].token_ids for o in engine.step()):
        pass
    engine.abort_request("r1")  # decoding
    engine.abort_request("r2")
    final = {o.request_id: o for o in drain(engine)}
    assert {o.outputs[0].finish_reason for o in final.values()} == {"abort"}
    assert engine.kv_manager.stats().num_used_blocks == 0
    assert engine.get_stats().num_running == engine.get_stats().num_waiting == 0


def test_rejects_requests_that_can_never_run(model_dirs: dict[str, Path]) -> None:
    """Too long prompts, prompt + max_tokens over max_model_len, and unknown token ids are refused with param."""
    engine = make_llm(model_dirs["llama"]).engine
    cases = [
        ([1] * 65, SamplingParams(max_tokens=1), "prompt"),
        ([1] * 60, SamplingParams(max_tokens=10), "max_tokens"),
        ([10**6], SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt"),
    ]
    for prompt, params, param in cases:
        with pytest.raises(RequestRejectedError) as info:
            engine.add_request("bad", prompt, params)
        assert info.value.param == param
    assert not engine.has_unfinished_requests()


def test_relays_what_only_the_scheduler_checks_with_its_field(model_dirs: dict[str, Path]) -> None:
    """n over max_num_seqs and a sample id in use come from the scheduler, naming their field; stop ids too."""
    engine = make_llm(model_dirs["llama"], max_num_seqs=2).engine
    engine.add_request("a", [1, 2, 3], SamplingParams(n=2, max_tokens=2))
    cases = [
        ("b", SamplingParams(n=3), "n"),
        (
            "a:1",
            SamplingParams(),
            "request_id",
        ),  # the engine has no request "a:1", the scheduler has the sample
        ("a", SamplingParams(), "request_id"),
        ("c", SamplingParams(stop_token_ids=(10**6,)), "stop_token_ids"),
    ]
    for request_id, params, param in cases:
        with pytest.raises(RequestRejectedError) as info:
            engine.add_request(request_id, [1, 2], params)
        assert info.value.param == param
    assert engine.get_num_unfinished_requests() == 1
    assert [len(o.outputs) for o in drain(engine) if o.finished] == [2]


def test_max_input_tokens_caps_the_prompt(model_dirs: dict[str, Path]) -> None:
    """TGI's --max-input-tokens: a longer prompt is refused naming the prompt; it must stay below max_model_len."""
    engine = make_llm(model_dirs["llama"], max_input_tokens=10).engine
    with pytest.raises(RequestRejectedError, match="max_input_tokens") as info:
        engine.add_request("long", [5] * 11, SamplingParams(max_tokens=2))
    assert info.value.param == "prompt"
    engine.add_request("fits", [5] * 10, SamplingParams(max_tokens=2))
    assert [o.finished for o in drain(engine)][-1]
    with pytest.raises(EngineConfigError, match="max-input-tokens"):
        make_llm(model_dirs["llama"], max_input_tokens=64)


def test_refuses_a_kv_cache_smaller_than_one_request(model_dirs: dict[str, Path]) -> None:
    """Startup fails with a message naming what to change when max_model_len does not fit."""
    with pytest.raises(EngineConfigError, match="max-model-len"):
        make_llm(model_dirs["llama"], num_kv_blocks=8, max_model_len=64)


# --- scheduling policy x KV reservation (issue 17 §2): static batching and contiguous reservation, live ---

# A pool of 40 blocks of 4 tokens holds two contiguous reservations of max_model_len 64 (16 blocks each).
CONTIGUOUS_POOL = {"num_kv_blocks": 40, "max_model_len": 64}


class Recording(NamedTuple):
    """What `run_recording` saw: tokens per prompt; after every step the running ids and the static batch."""

    tokens: list[list[int]]
    running: list[frozenset[str]]
    batches: list[frozenset[str]]


def run_recording(llm: LLM, prompts: Sequence[Sequence[int]]) -> Recording:
    """Generate greedily step by step, checking after every step that each running sequence holds a whole
    contiguous region (under `kv_manager="contiguous"`)."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    policy = engine.scheduler.policy
    final: dict[str, RequestOutput] = {}
    record = Recording([], [], [])
    while engine.has_unfinished_requests():
        final.update((o.request_id, o) for o in engine.step() if o.finished)
        record.running.append(frozenset(r.request_id for r in engine.scheduler.running))
        record.batches.append(policy.batch if isinstance(policy, StaticBatchPolicy) else frozenset())
        if engine.config.cache_config.kv_manager == "contiguous":
            assert engine.kv_manager.stats().num_used_blocks == 16 * len(record.running[-1])
    record.tokens.extend(list(final[f"r{i}"].outputs[0].token_ids) for i in range(len(prompts)))
    return record


@pytest.mark.parametrize(
    ("policy", "kv_manager", "max_num_seqs"),
    [("static", "contiguous", 3), ("fcfs", "contiguous", 4), ("static", "paged", 2)],
)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_static_batching_and_contiguous_reservation_are_exact(
    arch: str,
    policy: str,
    kv_manager: str,
    max_num_seqs: int,
    model_dirs: dict[str, Path],
    reference: Reference,
) -> None:
    """Static batches and contiguous regions (real slots of the inner paged allocator) give HF's tokens.

    Contiguous: at most two sequences run at once (two regions fit the pool), without preempting anyone.
    Static: only members of the batch in flight run, and a new batch forms only after the last drained.
    """
    prompts = random_prompts(PROMPT_LENS)
    llm = make_llm(
        model_dirs[arch],
        scheduling_policy=policy,
        kv_manager=kv_manager,
        max_num_seqs=max_num_seqs,
        **CONTIGUOUS_POOL,
    )
    record = run_recording(llm, prompts)
    assert_matches(reference, arch, prompts, record.tokens)
    assert llm.engine.kv_manager.stats().num_used_blocks == 0
    assert llm.engine.get_stats().num_preemptions == 0
    if kv_manager == "contiguous":
        assert max(map(len, record.running)) == 2
    if policy == "static":
        started = [record.batches[0]]
        for step in range(1, len(record.batches)):
            if record.batches[step] != record.batches[step - 1]:
                assert not record.running[step - 1], f"step {step}: a new batch while the last runs"
                started.append(record.batches[step])
        assert all(ids <= batch for ids, batch in zip(record.running, record.batches, strict=True))
        assert [len(b) for b in started] == [max_num_seqs] * (len(prompts) // max_num_seqs) + (
            [len(prompts) % max_num_seqs] if len(prompts) % max_num_seqs else []
        )


def test_static_batch_waits_for_its_timeout_and_admits_nobody_until_it_drains(
    model_dirs: dict[str, Path],
) -> None:
    """A lone request waits for the batch to fill (or its timeout); a request arriving mid-batch waits for
    the batch to drain, then starts alone once its own timeout has passed (arrival times set in the past)."""
    engine = make_llm(
        model_dirs["llama"], scheduling_policy="static", static_batch_timeout_s=60.0, max_num_seqs=2
    ).engine
    long = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], long)
    assert engine.step() == [] and engine.get_stats().num_waiting == 1  # 1 of 2 seats, 60 s to go
    engine.add_request("b", [8, 9], short)
    engine.step()
    assert {r.request_id for r in engine.scheduler.running} == {"a", "b"}
    engine.add_request("c", [10, 11], short, arrival_time=time.monotonic() - 120.0)  # overdue at once
    finished: list[str] = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
        running = {r.request_id for r in engine.scheduler.running}
        assert "c" not in running or finished == ["b", "a"], (finished, running)
    assert finished == ["b", "a", "c"]  # b finished while a ran on, and c joined only after a


@pytest.mark.slow
def test_gemma3_270m_generates_coherent_text(tmp_path: Path) -> None:
    """The real Gemma 3 270M (a base model) continues a fixed prompt sensibly, exactly as transformers does
    (on a float32 copy of the converted cache, whose weights stay in their GGUF block formats)."""
    llm = LLM("gemma3-270m", max_model_len=256, kv_cache_gib=0.25, dtype="float32")
    assert llm.engine.model_name == "gemma3-270m"  # the short name is the served name (/v1/models)
    prompt = "The capital of France is"
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert "France" in out.text and out.text.strip()[0].isalpha()
    reference = dense_copy(llm.engine.model_path, tmp_path / "dense")
    hf = cast(Any, AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32))
    ids = llm.tokenizer(prompt, return_tensors="pt").input_ids
    expected = hf.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :].tolist()
    assert list(out.token_ids) == expected
