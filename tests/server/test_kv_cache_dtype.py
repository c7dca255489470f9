"""`--kv-cache-dtype`: int8 KV in the engine (bytes, greedy agreement with float32 KV, prefix caching, swaps,
forks) and fp8's refusal where it cannot run.

Random-weight tiny models have flat logits: on the tiny llama, qwen3 and mistral the top two logprobs of many
positions lie within 0.01 of each other, less than int8's perturbation (0.01-0.03, measured), so 65-85% of
prompts keep their first 16 greedy tokens there. The tiny gemma3 (the default model's architecture, whose
embedding scale and QK-norm give peaked logits) keeps them on 100% of 20 prompts; the bound is asserted there.
Where the engine's runs are compared with each other (prefix caching, swaps, forks) int8 KV is compared with
int8 KV, exactly, and every scale starts as NaN, so a block move that drops its scales shows.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from pagoda.pagedkernel import get_backend
from pagoda.scheduler import SchedulerOutput
from pagoda.server.cli import main
from pagoda.server.engine.kv_cache import KVCache, KVCacheShape
from pagoda.server.engine.kv_dtype import KVCacheDtypeError
from pagoda.server.llm import LLM
from pagoda.server.models.attention import LayerKVCache
from pagoda.server.outputs import RequestOutput
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import make_tiny_model

TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
AGREEMENT = 0.9  # share of prompts whose first 16 greedy tokens equal the float32-KV path's


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny models these tests run."""
    root = tmp_path_factory.mktemp("kv-dtype-models")
    return {arch: make_tiny_model(arch, root / arch) for arch in ("llama", "gemma3")}


def _prompts(count: int, seed: int, low: int = 3, high: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=g).tolist()
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


def _llm(model_dir: Path, **kwargs: Any) -> LLM:
    args: dict[str, Any] = {"block_size": 4, "num_kv_blocks": 256, "max_model_len": 80, "dtype": "float32"}
    args.update(kwargs)
    return LLM(str(model_dir), **args)


def _tokens(outputs: Sequence[RequestOutput], index: int = 0) -> list[list[int]]:
    return [list(o.outputs[index].token_ids) for o in outputs]


def _poison_scales(llm: LLM) -> None:
    """NaN in every device and host scale: only scales the engine wrote (or moved) may be read."""
    cache = llm.engine.runner.kv_cache
    for layer in [*cache.device_caches, *cache.host_caches]:
        assert layer.k_scale is not None and layer.v_scale is not None
        layer.k_scale.fill_(float("nan"))
        layer.v_scale.fill_(float("nan"))


def _poison_move_targets(llm: LLM) -> None:
    """Before every swap and copy-on-write, NaN in the destination blocks' scales (device and host): a move
    that does not carry its blocks' scales then reads NaN, not a stale scale that happens to be close."""
    cache = llm.engine.runner.kv_cache
    moves = {"swap_out": cache.host_caches, "swap_in": cache.device_caches, "copy": cache.device_caches}
    for name, targets in moves.items():
        move = getattr(cache, name)

        def poisoned(
            pairs: tuple[tuple[int, int], ...], move: Any = move, targets: list[LayerKVCache] = targets
        ) -> None:
            dst = [d for _, d in pairs]
            for layer in targets:
                assert layer.k_scale is not None and layer.v_scale is not None
                layer.k_scale[dst] = float("nan")
                layer.v_scale[dst] = float("nan")
            move(pairs)

        setattr(cache, name, poisoned)


def _spy(llm: LLM) -> list[SchedulerOutput]:
    """Every SchedulerOutput the engine's scheduler hands out."""
    steps: list[SchedulerOutput] = []
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule

    def spy() -> SchedulerOutput:
        out = schedule()
        steps.append(out)
        return out

    scheduler.schedule = spy  # type: ignore[method-assign]
    return steps


def _pool_bytes_per_token(llm: LLM) -> float:
    """Bytes of every device cache tensor (scales included) over the pool's token slots."""
    cache = llm.engine.runner.kv_cache
    tensors = [t for layer in cache.device_caches for t in (layer.k, layer.v, layer.k_scale, layer.v_scale)]
    total = sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return total / (cache.num_blocks * cache.shape.block_size)


def test_int8_halves_the_kv_bytes_per_token(model_dirs: dict[str, Path]) -> None:
    """The pool's tensors take half of bfloat16's bytes per token, plus the scales (per layer and KV head, 2 B per
    key channel and block, 4 B per value row); the shape's arithmetic (what sizes the pool) says the same."""
    bf16 = _llm(model_dirs["llama"], dtype="bfloat16", block_size=16, num_kv_blocks=8)
    int8 = _llm(model_dirs["llama"], dtype="bfloat16", block_size=16, num_kv_blocks=8, kv_cache_dtype="int8")
    assert int8.engine.runner.kv_cache.shape.storage_dtype == torch.int8
    ours, theirs = _pool_bytes_per_token(int8), _pool_bytes_per_token(bf16)
    assert ours == int8.engine.runner.kv_cache.shape.bytes_per_token
    assert theirs == bf16.engine.runner.kv_cache.shape.bytes_per_token
    head_dim, block_size = 16, 16  # the tiny llama's
    # Per KV head and block: int8 rows of K and V, bfloat16 key-channel scales, float32 value-row scales.
    int8_block = 2 * head_dim * block_size + 2 * head_dim + 4 * block_size
    assert ours == theirs * int8_block / (4 * head_dim * block_size)
    assert 0.5 * theirs < ours
    shape = KVCacheShape(18, 1, 256, 16, torch.bfloat16)  # Gemma 3 270M
    assert shape.bytes_per_token == 18432  # the 18.4 KB per token
    int8_gemma = KVCacheShape(18, 1, 256, 16, torch.bfloat16, torch.int8).bytes_per_token
    # + per layer 256 bfloat16 K channel scales and 16 float32 V row scales per 16-token block
    assert int8_gemma == 9216 + 18 * (2 * 256 + 4 * 16) / 16 == 9864
    assert int8_gemma <= 0.54 * 18432  # 0.535x (llama.cpp's q8_0: 0.53x)


def test_int8_greedy_agrees_with_float32_kv(model_dirs: dict[str, Path]) -> None:
    """Greedy with int8 KV keeps the float32-KV path's first 16 tokens on at least 90% of 30 prompts (gemma3),
    and generates from every prompt on llama too (see the module docstring for why the bound is gemma3's)."""
    prompts = _prompts(30, seed=0, high=60)
    reference = _tokens(_llm(model_dirs["gemma3"]).generate(prompts, GREEDY, use_tqdm=False))
    int8 = _llm(model_dirs["gemma3"], kv_cache_dtype="int8")
    _poison_scales(int8)
    got = _tokens(int8.generate(prompts, GREEDY, use_tqdm=False))
    same = sum(a == b for a, b in zip(got, reference, strict=True))
    assert same >= AGREEMENT * len(prompts), f"{same} of {len(prompts)}"
    llama = _tokens(
        _llm(model_dirs["llama"], kv_cache_dtype="int8").generate(prompts, GREEDY, use_tqdm=False)
    )
    assert all(len(t) == TOKENS for t in llama)


def test_int8_prefix_cache_hits_equal_a_run_without_them(model_dirs: dict[str, Path]) -> None:
    """A batch sharing a 24-token prefix with an earlier one hits the cache (the hit's blocks keep their
    scales) and generates what the same batch does with prefix caching off."""
    shared = _prompts(1, seed=2, low=24, high=25)[0]
    first = [shared + tail for tail in _prompts(2, seed=3, low=3, high=6)]
    second = [shared + tail for tail in _prompts(3, seed=4, low=2, high=8)]
    cached = _llm(model_dirs["gemma3"], kv_cache_dtype="int8")
    _poison_scales(cached)
    cached.generate(first, GREEDY, use_tqdm=False)
    outputs = cached.generate(second, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens == 24 for o in outputs)
    fresh = _llm(model_dirs["gemma3"], kv_cache_dtype="int8", enable_prefix_caching=False)
    assert _tokens(outputs) == _tokens(fresh.generate(second, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("kernel_backend", ["torch", "cpu"])
def test_int8_swap_preemption_carries_the_scales(model_dirs: dict[str, Path], kernel_backend: str) -> None:
    """A pool too small for the batch swaps victims to the host tier and back; the scales travel with the
    blocks (host and device scales start as NaN, and so do a move's destinations), so the tokens equal a run
    that never preempts. The torch kernels let a NaN scale reach the output; the C kernel skips a block whose K
    scale is NaN (its scores compare as not visible), so on it a missing move could hide: both run."""
    prompts = _prompts(6, seed=1, low=18, high=26)
    roomy = _llm(model_dirs["gemma3"], kv_cache_dtype="int8", max_model_len=48, kernel_backend=kernel_backend)
    expected = _tokens(roomy.generate(prompts, GREEDY, use_tqdm=False))
    tight = _llm(
        model_dirs["gemma3"],
        kv_cache_dtype="int8",
        num_kv_blocks=24,
        max_model_len=48,
        preemption_mode="swap",
        swap_space_gib=0.01,
        kernel_backend=kernel_backend,
    )
    _poison_scales(tight)
    _poison_move_targets(tight)
    steps = _spy(tight)
    got = _tokens(tight.generate(prompts, GREEDY, use_tqdm=False))
    assert any(out.blocks_to_swap_out for out in steps) and any(out.blocks_to_swap_in for out in steps)
    assert got == expected


@pytest.mark.parametrize("kernel_backend", ["torch", "cpu"])
def test_int8_forks_copy_the_scales_on_write(model_dirs: dict[str, Path], kernel_backend: str) -> None:
    """n = 2 greedy: the samples share the prompt's blocks, the partial last one copied on write with its
    scales (its destination's scales NaN before the copy); both samples equal the single sample. As for
    swaps, the torch kernels are the ones on which a missing scale copy cannot hide."""
    prompts = _prompts(3, seed=5, low=9, high=15)
    int8: dict[str, Any] = {"kv_cache_dtype": "int8", "kernel_backend": kernel_backend}
    single = _tokens(_llm(model_dirs["gemma3"], **int8).generate(prompts, GREEDY, use_tqdm=False))
    llm = _llm(model_dirs["gemma3"], **int8)
    _poison_scales(llm)
    _poison_move_targets(llm)
    steps = _spy(llm)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert any(out.blocks_to_copy for out in steps)
    assert _tokens(outputs, 0) == single and _tokens(outputs, 1) == single


def test_block_moves_carry_scales_exactly() -> None:
    """KVCache.copy and a swap out and back in move each block's int8 rows and both scales."""
    shape = KVCacheShape(2, 2, 8, 4, torch.float32, torch.int8)
    cache = KVCache(shape, 6, 3, torch.device("cpu"), get_backend("cpu", "cpu"))
    layers = [_tensors(layer) for layer in cache.device_caches]
    for k, v, k_scale, v_scale in layers:
        for t in (k, v):
            t.copy_(torch.randint(-127, 128, t.shape, dtype=torch.int8))
        for s in (k_scale, v_scale):
            s.copy_(torch.rand(s.shape))
    before = [[t.clone() for t in tensors] for tensors in layers]
    cache.copy(((1, 4),))
    cache.swap_out(((2, 0),))
    cache.swap_in(((0, 5),))
    for tensors, old in zip(layers, before, strict=True):
        for t, o in zip(tensors, old, strict=True):
            assert torch.equal(t[4], o[1]) and torch.equal(t[5], o[2])


def _tensors(layer: LayerKVCache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """k, v and the two scales of an int8 layer cache."""
    assert layer.k_scale is not None and layer.v_scale is not None
    return layer.k, layer.v, layer.k_scale, layer.v_scale


def test_fp8_on_the_cpu_is_refused(model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8 runs on CUDA only: LLM raises, naming the flag and the alternative."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        with pytest.raises(
            KVCacheDtypeError, match=rf"--kv-cache-dtype {name} \(kv_cache_dtype\) needs CUDA"
        ):
            _llm(model_dirs["llama"], kv_cache_dtype=name)


def test_fp8_serve_on_the_cpu_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pagoda serve --kv-cache-dtype fp8` without CUDA: status 2 and the reason, before any model loads."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["serve", "unused-model", "--kv-cache-dtype", "fp8"]) == 2
    err = capsys.readouterr().err
    assert "--kv-cache-dtype fp8" in err and "needs CUDA" in err and "int8" in err


def test_unknown_kv_cache_dtype_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    """argparse refuses a name outside vLLM's list; the config names its field."""
    with pytest.raises(SystemExit) as info:
        main(["serve", "unused-model", "--kv-cache-dtype", "int4"])
    assert info.value.code == 2 and "--kv-cache-dtype" in capsys.readouterr().err
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM("unused-model", kv_cache_dtype="int4")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["int8", "fp8", "fp8_e5m2"])
def test_quantized_kv_on_cuda(model_dirs: dict[str, Path], name: str) -> None:
    """On CUDA (Triton: fp8 and int8 attention native, int8 writes the torch reference's) greedy keeps the
    float32-KV tokens on at least 90% of prompts for int8 and fp8 (e4m3); e5m2 (two mantissa bits) must generate
    every token."""
    prompts = _prompts(20, seed=0, high=60)
    cuda: dict[str, Any] = {"device": "cuda", "enforce_eager": True}
    reference = _tokens(_llm(model_dirs["gemma3"], **cuda).generate(prompts, GREEDY, use_tqdm=False))
    llm = _llm(model_dirs["gemma3"], kv_cache_dtype=name, **cuda)
    got = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert all(len(t) == TOKENS for t in got)
    if name != "fp8_e5m2":
        same = sum(a == b for a, b in zip(got, reference, strict=True))
        assert same >= AGREEMENT * len(prompts), f"{same} of {len(prompts)}"
