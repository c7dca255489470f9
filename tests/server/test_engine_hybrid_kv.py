"""KV cache groups in the engine (issue 29): sliding-window layers keep only their window, and greedy output still
equals transformers' in float32 on the tiny mistral (every layer sliding) and gemma3 (sliding, full, sliding)
models, with prompts of at least 3 windows, under chunked prefill, prefix caching, preemption by recompute and
by swap, n = 2 forks and beams; `--disable-hybrid-kv-cache-manager` keeps one table for every layer."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from pagoda.scheduler import SchedulerOutput
from pagoda.server.beam_search import BeamSearchParams
from pagoda.server.cli_args import build_parser, engine_config
from pagoda.server.engine import EngineConfigError
from pagoda.server.llm import LLM
from pagoda.server.metrics import ServerMetrics
from pagoda.server.outputs import RequestOutput
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import SLIDING_WINDOW, make_tiny_model
from prometheus_client import generate_latest
from transformers import AutoModelForCausalLM, PreTrainedModel

BS = 4
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
LONG = (25, 31, 40, 27)  # every prompt at least 3 windows of 8
LOCAL_LIMIT = -(-SLIDING_WINDOW // BS) + 1  # blocks a local group may hold after a decode step


def prompts_of(lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths (ids clear of the special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The two tiny architectures with sliding-window layers."""
    root = tmp_path_factory.mktemp("hybrid-models")
    return {arch: make_tiny_model(arch, root / arch) for arch in ("mistral", "gemma3")}


class Reference:
    """transformers' float32 greedy generations, once per (arch, prompt)."""

    def __init__(self, model_dirs: dict[str, Path]) -> None:
        self.models = {
            arch: cast(PreTrainedModel, AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32))
            for arch, d in model_dirs.items()
        }
        self.cache: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def greedy(self, arch: str, prompt: Sequence[int]) -> list[int]:
        """The tokens of HF's greedy generate for one prompt alone."""
        key = (arch, tuple(prompt))
        if key not in self.cache:
            out = cast(Any, self.models[arch]).generate(
                torch.tensor([list(prompt)]),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            self.cache[key] = out[0, len(prompt) :].tolist()
        return self.cache[key]


@pytest.fixture(scope="module")
def reference(model_dirs: dict[str, Path]) -> Reference:
    """Shared by the module."""
    return Reference(model_dirs)


def make_llm(model_dir: Path, hybrid: bool, **kwargs: Any) -> LLM:
    """float32 like the reference, blocks of 4, hybrid KV cache groups on or off."""
    args: dict[str, Any] = {
        "block_size": BS,
        "num_kv_blocks": 256,
        "max_model_len": 64,
        "dtype": "float32",
        "disable_hybrid_kv_cache_manager": not hybrid,
    }
    args.update(kwargs)
    return LLM(str(model_dir), **args)


class Steps:
    """Keeps every SchedulerOutput of an engine's scheduler."""

    def __init__(self, llm: LLM) -> None:
        self.outputs: list[SchedulerOutput] = []
        scheduler = llm.engine.scheduler
        schedule = scheduler.schedule

        def spy() -> SchedulerOutput:
            out = schedule()
            self.outputs.append(out)
            return out

        scheduler.schedule = spy  # type: ignore[method-assign]

    def max_local_blocks_at_decode(self, local_groups: Sequence[int]) -> int:
        """The most non-null blocks any sliding group's table held in a decode chunk."""
        most = 0
        for out in self.outputs:
            for c in out.scheduled:
                if c.num_tokens != 1:
                    continue
                tables = c.group_block_tables or (c.block_table,)
                most = max([most, *(sum(1 for b in tables[g] if b != 0) for g in local_groups)])
        return most


def local_groups(llm: LLM) -> list[int]:
    """Indices of the engine's sliding-window groups (from its KV cache layout)."""
    layout = llm.engine.runner.kv_cache.shape.layout
    assert layout is not None
    return [i for i, g in enumerate(layout.groups) if g.sliding_window is not None]


def generated(outputs: Sequence[RequestOutput], index: int = 0) -> list[list[int]]:
    """Token ids of sample `index` of each output."""
    return [list(o.outputs[index].token_ids) for o in outputs]


def test_layouts(model_dirs: dict[str, Path]) -> None:
    """gemma3: a full group and two window groups of one layer; mistral: one window group of both layers; off:
    one full group of every layer (today's layout), with the same KV memory in both."""
    gemma = make_llm(model_dirs["gemma3"], True)
    kv = gemma.engine.kv_manager
    assert kv.num_kv_cache_groups == 3 and kv.has_sliding_window and local_groups(gemma) == [1, 2]
    assert kv.num_blocks == 3 * 256 - 1  # blocks of one layer each, the null block aside
    mistral = make_llm(model_dirs["mistral"], True)
    assert mistral.engine.kv_manager.num_kv_cache_groups == 1 and mistral.engine.kv_manager.has_sliding_window
    for arch in ("gemma3", "mistral"):
        off = make_llm(model_dirs[arch], False)
        assert off.engine.kv_manager.num_kv_cache_groups == 1 and not off.engine.kv_manager.has_sliding_window
        assert off.engine.runner.kv_cache.shape.layout is None and off.engine.kv_manager.num_blocks == 256


SCENARIOS: dict[str, dict[str, Any]] = {
    "chunked": {"max_num_batched_tokens": 8},
    "recompute": {"num_kv_blocks": 16, "max_model_len": 56, "preemption_mode": "recompute"},
    "swap": {"num_kv_blocks": 16, "max_model_len": 56, "preemption_mode": "swap", "swap_space_gib": 0.01},
}


def scenario_args(arch: str, hybrid: bool, scenario: str) -> dict[str, Any]:
    """The scenario's engine arguments. The preempting pools (16 blocks' memory) run chunks of 8 so that admissions
    overcommit. Mistral's windows-only groups never preempt: a sequence's window never grows, a prefill chunk
    shrinks to the free blocks and gives its window's passed blocks back as soon as it ran."""
    args = dict(SCENARIOS[scenario])
    if scenario != "chunked" and not (arch == "mistral" and hybrid):
        args["max_num_batched_tokens"] = 8
    return args


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("hybrid", [True, False])
@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_greedy_equals_transformers(
    arch: str, hybrid: bool, scenario: str, model_dirs: dict[str, Path], reference: Reference
) -> None:
    """HF's tokens for long prompts; the local groups hold at most ceil(W / bs) + 1 blocks at each decode; the
    preempting pools really preempt. The cache starts as NaN: null-block and out-of-window entries are never read."""
    prompts = prompts_of((*LONG, 33, 29), seed=1)
    llm = make_llm(model_dirs[arch], hybrid, **scenario_args(arch, hybrid, scenario))
    cache = llm.engine.runner.kv_cache
    for k, v in [*cache.device_caches, *cache.host_caches]:
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    steps = Steps(llm)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, got in zip(prompts, generated(outputs), strict=True):
        assert got == reference.greedy(arch, prompt), f"prompt of {len(prompt)} tokens"
    if hybrid:
        assert steps.max_local_blocks_at_decode(local_groups(llm)) <= LOCAL_LIMIT
    if scenario == "chunked":
        assert any(not c.num_samples for out in steps.outputs for c in out.scheduled)  # split prefills
    elif arch == "mistral" and hybrid:
        assert llm.engine.get_stats().num_preemptions == 0
    else:
        assert llm.engine.get_stats().num_preemptions > 0
    if scenario == "swap" and not (arch == "mistral" and hybrid):
        assert any(out.blocks_to_swap_in for out in steps.outputs)
    assert llm.engine.kv_manager.stats().num_used_blocks == 0


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_prefix_hits_before_and_after_the_window(
    arch: str, model_dirs: dict[str, Path], reference: Reference
) -> None:
    """A first request runs past its prefix (its local blocks there are released, still cached); later ones hit
    6 blocks (after the window: only the window's blocks are needed locally) and 1 block (inside the first
    window), and stay exact."""
    first = prompts_of((40,), seed=5)[0]
    llm = make_llm(model_dirs["gemma3" if arch == "gemma3" else "mistral"], True, max_num_batched_tokens=8)
    assert generated(llm.generate([first], GREEDY, use_tqdm=False)) == [reference.greedy(arch, first)]
    after = first[:24] + prompts_of((9,), seed=6)[0]
    before = first[:4] + prompts_of((26,), seed=7)[0]
    for prompt, hit in ((after, 24), (before, 4)):
        (out,) = llm.generate([prompt], GREEDY, use_tqdm=False)
        assert out.num_cached_tokens == hit
        assert generated([out]) == [reference.greedy(arch, prompt)]


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_parallel_samples_and_beams_match_the_one_table_layout(
    arch: str, model_dirs: dict[str, Path], reference: Reference
) -> None:
    """n = 2 greedy samples (forked, copy-on-write in every group) equal HF's; beam search over long prompts
    gives the same beams and scores with the groups as with one table (which test_beam_search checks against
    transformers)."""
    prompts = prompts_of((26, 31), seed=8)
    hybrid = make_llm(model_dirs[arch], True)
    outputs = hybrid.generate(
        prompts, SamplingParams(n=2, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False
    )
    for index in (0, 1):
        for prompt, got in zip(prompts, generated(outputs, index), strict=True):
            assert got == reference.greedy(arch, prompt)
    params = BeamSearchParams(3, MAX_TOKENS)
    beams_on = hybrid.beam_search(prompts, params, use_tqdm=False)
    beams_off = make_llm(model_dirs[arch], False).beam_search(prompts, params, use_tqdm=False)
    for on, off in zip(beams_on, beams_off, strict=True):
        assert [s.tokens for s in on.sequences] == [s.tokens for s in off.sequences]
        assert [s.cum_logprob for s in on.sequences] == pytest.approx([s.cum_logprob for s in off.sequences])
    assert hybrid.engine.kv_manager.stats().num_used_blocks == 0


def test_max_model_len_defaults_to_the_models_and_a_too_long_one_names_both_numbers(
    model_dirs: dict[str, Path],
) -> None:
    """Without --max-model-len the tiny gemma3's own 256 positions are served when one sequence fits; a length the
    pool cannot hold for one sequence is refused with that length and the longest that fits."""
    llm = make_llm(model_dirs["gemma3"], True, max_model_len=None)
    assert llm.engine.max_model_len == 256
    with pytest.raises(EngineConfigError, match=r"max_model_len 200 does not fit.*at most 108 tokens"):
        make_llm(model_dirs["gemma3"], True, num_kv_blocks=12, max_model_len=200)


def test_flag_maps_onto_the_cache_config() -> None:
    """`--disable-hybrid-kv-cache-manager` sets CacheConfig.disable_hybrid_kv_cache_manager (default off)."""
    on = engine_config(build_parser().parse_args(["serve", "m"]))
    off = engine_config(build_parser().parse_args(["serve", "m", "--disable-hybrid-kv-cache-manager"]))
    assert not on.cache_config.disable_hybrid_kv_cache_manager
    assert off.cache_config.disable_hybrid_kv_cache_manager


def test_kv_usage_per_group_reaches_the_stats_and_metrics(model_dirs: dict[str, Path]) -> None:
    """Mid-decode a local group holds fewer blocks than the full group; /metrics has one gauge per group."""
    llm = make_llm(model_dirs["gemma3"], True)
    engine = llm.engine
    engine.add_request("r", prompts_of((40,), seed=9)[0], GREEDY)
    for _ in range(3):  # the prefill, then two decodes
        engine.step()
    stats = engine.get_stats()
    full, *local = stats.kv_cache_usage_per_group
    assert len(local) == 2 and full == 11 / 767 and all(u == 3 / 767 for u in local)
    text = generate_latest(ServerMetrics("m", engine.get_stats).registry).decode()
    assert 'pagoda:kv_cache_group_usage_perc{kv_cache_group="1",model_name="m"}' in text
    off = make_llm(model_dirs["gemma3"], False).engine.get_stats()
    assert off.kv_cache_usage_per_group == ()
