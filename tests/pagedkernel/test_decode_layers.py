"""The native decode layers (csrc/cpu_decode.c) against the ops a Llama decoder layer calls one by one.

The reference is the chain the server's `LlamaDecoderLayer` runs on the CPU: `fused.rms_norm`, `qmatmul` per run of
rows, `fused.rotary`, the cpu backend's `reshape_and_cache` and `paged_decode_attention`, `fused.add_rms_norm`,
`fused.act_and_mul` and the residual add. The C file calls the very same kernel code in the same order, with every
rounding in the same place (float32 accumulation in the same lanes, the same dtype roundings), so the tolerance the
arithmetic gives is zero: outputs and the written cache rows must be bitwise equal. Unused cache slots hold NaN
(attention must never read them) and so does the slot each new token goes to (it must be written before it is
read); context lengths cross block boundaries (block size 4); 1-4 rows, three layers, mixed GGUF formats and
repacked layouts. Steps
whose sequences bring several tokens each (a speculative step's token and drafts, a short prompt chunk) are
checked against the prefill attention op, which the module path calls for them; steps past the GEMV's 16 rows
(where qmatmul sends row-major weights to its vector path, repacked ones still to their int8 tiles) up to the
call's 64.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from pagoda.pagedkernel import csrc, fused, get_backend
from pagoda.pagedkernel.cbuild import cpu_flags, for_march
from pagoda.pagedkernel.decode import DecodeLayer, DecodeShape, DecodeStack, cpu_decode
from pagoda.pagedkernel.quant import GGMLType, QuantizedTensor, cpu_quant, qmatmul
from pagoda.pagedkernel.quant.testing import random_weight
from pagoda.pagedkernel.testing import c_kernel_or_skip
from torch import Tensor

SHAPE = DecodeShape(hidden=256, num_heads=4, num_kv_heads=2, head_dim=64, inner=512, eps=1e-5, scale=64**-0.5)
BLOCK_SIZE = 4
NUM_BLOCKS = 48  # at least: a case of more sequences has MAX_BLOCKS for each
MAX_BLOCKS = 8
Q, KV = SHAPE.num_heads * SHAPE.head_dim, SHAPE.num_kv_heads * SHAPE.head_dim
# Each layer's weights: runs of rows of several formats (q / k / v and gate / up of different types, as llama.cpp's
# mixes are), covering the one-row register path (Q4_0, Q5_0, Q8_0) and the unpacking one (the rest).
FORMATS = (
    {
        "qkv": [(GGMLType.Q8_0, Q), (GGMLType.Q4_K, KV), (GGMLType.Q5_0, KV)],
        "o": [(GGMLType.Q4_1, SHAPE.hidden)],
        "gate_up": [(GGMLType.Q4_0, SHAPE.inner), (GGMLType.Q6_K, SHAPE.inner)],
        "down": [(GGMLType.Q5_1, SHAPE.hidden)],
    },
    {
        "qkv": [(GGMLType.Q4_1, Q + 2 * KV)],
        "o": [(GGMLType.Q8_0, SHAPE.hidden)],
        "gate_up": [(GGMLType.Q5_K, 2 * SHAPE.inner)],
        "down": [(GGMLType.Q4_0, SHAPE.hidden)],
    },
    {  # the repacked layouts (sixteen rows to a tile), beside a plain run whose x is unsigned on the VNNI path
        "qkv": [(GGMLType.Q5_0_R16, Q), (GGMLType.Q8_0_R16, KV), (GGMLType.Q5_0, KV)],
        "o": [(GGMLType.Q4_K_R16, SHAPE.hidden)],
        "gate_up": [(GGMLType.Q5_0_R16, SHAPE.inner), (GGMLType.Q4_1_R16, SHAPE.inner)],
        "down": [(GGMLType.Q6_K_R16, SHAPE.hidden)],
    },
)


@dataclass
class Case:
    """Two layers' weights and caches, and one step's rows (one per sequence unless `starts` says otherwise)."""

    layers: list[DecodeLayer]
    shape: DecodeShape
    x: Tensor  # [rows, hidden]
    cos: Tensor  # [ropes, rows, head_dim // 2]
    sin: Tensor
    slots: Tensor  # int64 [groups, rows]
    tables: Tensor  # int32 [groups, num_seqs, MAX_BLOCKS]
    lens: Tensor  # int32 [num_seqs]
    starts: Tensor | None = None  # int32 [num_seqs + 1]: sequence i's rows; None: one row per sequence


def weight(runs: Sequence[tuple[GGMLType, int]], k: int, gen: torch.Generator) -> list[QuantizedTensor]:
    """Random blocks, run by run (scales sized so that activations stay of order one through the layers)."""
    return [random_weight(qtype, (rows, k), gen, scale=0.02 / math.sqrt(k / 256)) for qtype, rows in runs]


def norm_weight(size: int, gen: torch.Generator, dtype: torch.dtype, gemma: bool) -> Tensor:
    """A norm's weight: about 1 (Llama's w), or about 0 (Gemma's w of 1 + w)."""
    return ((0.0 if gemma else 1.0) + 0.1 * torch.randn(size, generator=gen)).to(dtype)


def make_case(
    rows: int,
    dtype: torch.dtype,
    seed: int,
    context_lens: Sequence[int],
    gemma: bool = False,
    qk_norms: bool = False,
    q_lens: Sequence[int] | None = None,
) -> Case:
    """Random layers and caches: each sequence's earlier tokens written, everything else NaN. `q_lens`: the new
    tokens of each of the `rows` sequences (default one each; the step then has sum(q_lens) rows). `gemma`: Gemma 3's
    layer (sandwich norms, q/k norms, GELU, (1 + w) norms, soft-capping), each layer in its own KV cache group
    (its own block tables and slots) with its own rotary table, as Gemma's sliding and full layers are. `qk_norms`:
    Llama's layer with Qwen 3's per-head q/k norms."""
    gen = torch.Generator().manual_seed(seed)
    groups = 2 if gemma else 1
    num_seqs = rows
    news = [1] * num_seqs if q_lens is None else list(q_lens)
    num_blocks = max(NUM_BLOCKS, num_seqs * MAX_BLOCKS)
    tables = torch.stack(
        [
            torch.randperm(num_blocks, generator=gen)[: num_seqs * MAX_BLOCKS].reshape(num_seqs, MAX_BLOCKS)
            for _ in range(groups)
        ]
    ).to(torch.int32)
    lens = torch.tensor(list(context_lens)[:num_seqs], dtype=torch.int32)
    # each row's sequence and position: sequence s's new tokens are its last news[s] positions
    row_seq = [s for s in range(num_seqs) for _ in range(news[s])]
    row_pos = [int(lens[s]) - news[s] + t for s in range(num_seqs) for t in range(news[s])]
    slots = torch.stack(
        [
            torch.tensor(
                [
                    int(tables[g, s, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE
                    for s, pos in zip(row_seq, row_pos, strict=True)
                ],
                dtype=torch.int64,
            )
            for g in range(groups)
        ]
    )
    layers = []
    for index, formats in enumerate(FORMATS):
        group = index % groups
        shape = (num_blocks, BLOCK_SIZE, SHAPE.num_kv_heads, SHAPE.head_dim)
        k_cache = torch.full(shape, float("nan"), dtype=dtype)
        v_cache = torch.full(shape, float("nan"), dtype=dtype)
        for r in range(num_seqs):
            # the new tokens' slots stay NaN until the step writes them
            for pos in range(int(lens[r]) - news[r]):
                block, offset = int(tables[group, r, pos // BLOCK_SIZE]), pos % BLOCK_SIZE
                k_cache[block, offset] = torch.randn(shape[2:], generator=gen).to(dtype)
                v_cache[block, offset] = torch.randn(shape[2:], generator=gen).to(dtype)
        extra: dict[str, Tensor] = {}
        if qk_norms:
            extra = {name: norm_weight(SHAPE.head_dim, gen, dtype, gemma) for name in ("q_norm", "k_norm")}
        if gemma:
            extra = {
                name: norm_weight(size, gen, dtype, gemma)
                for name, size in [
                    ("attn_out_norm", SHAPE.hidden),
                    ("mlp_out_norm", SHAPE.hidden),
                    ("q_norm", SHAPE.head_dim),
                    ("k_norm", SHAPE.head_dim),
                ]
            }
        layers.append(
            DecodeLayer(
                input_norm=norm_weight(SHAPE.hidden, gen, dtype, gemma),
                mlp_norm=norm_weight(SHAPE.hidden, gen, dtype, gemma),
                qkv=weight(formats["qkv"], SHAPE.hidden, gen),
                o=weight(formats["o"], Q, gen),
                gate_up=weight(formats["gate_up"], SHAPE.hidden, gen),
                down=weight(formats["down"], SHAPE.inner, gen),
                k_cache=k_cache,
                v_cache=v_cache,
                sliding_window=None if index == 0 else 6,
                rope=group,  # Gemma: each attention kind its own table, as its own cache group
                group=group,
                **extra,
            )
        )
    positions = torch.tensor(row_pos, dtype=torch.float32)
    tables_of_angles = []
    for base in (10000.0, 1e6)[: 2 if gemma else 1]:  # Gemma's local and global rope bases
        inv_freq = 1.0 / (base ** (torch.arange(0, SHAPE.head_dim, 2).float() / SHAPE.head_dim))
        tables_of_angles.append(positions[:, None] * inv_freq[None, :])
    angles = torch.stack(tables_of_angles)
    form = replace(SHAPE, unit_offset=True, activation="gelu_tanh", logit_softcap=20.0) if gemma else SHAPE
    x = torch.randn(len(row_pos), SHAPE.hidden, generator=gen).to(dtype)
    starts = None if q_lens is None else torch.tensor([0, *itertools.accumulate(news)], dtype=torch.int32)
    return Case(layers, form, x, angles.cos().to(dtype), angles.sin().to(dtype), slots, tables, lens, starts)


def matmul(x: Tensor, runs: Sequence[QuantizedTensor]) -> Tensor:
    """x W^T with each run of rows writing its own columns (QuantizedWeight.matmul's way)."""
    y = torch.empty((x.shape[0], sum(r.shape[0] for r in runs)), dtype=x.dtype)
    start = 0
    for run in runs:
        qmatmul(x, run, backend="cpu", out=y[:, start : start + run.shape[0]])
        start += run.shape[0]
    return y


def reference(case: Case) -> Tensor:
    """The layers as the server's modules chain the ops (the caches are written as they go): LlamaDecoderLayer's
    chain, or Gemma3DecoderLayer's when the case has (1 + w) norms."""
    backend = get_backend("cpu", torch.device("cpu"))
    x = case.x.clone()
    rows, d, sh = x.shape[0], SHAPE.head_dim, case.shape
    uo = sh.unit_offset
    for layer in case.layers:
        cos, sin = case.cos[layer.rope][:, None, :], case.sin[layer.rope][:, None, :]
        h = fused.rms_norm(x, layer.input_norm, sh.eps, unit_offset=uo, backend="cpu")
        q, k, v = torch.split(matmul(h, layer.qkv), [Q, KV, KV], dim=-1)
        q = fused.rotary(
            q.view(rows, SHAPE.num_heads, d),
            cos,
            sin,
            norm_weight=layer.q_norm,
            eps=sh.eps,
            unit_offset=uo,
            backend="cpu",
        )
        k = fused.rotary(
            k.view(rows, SHAPE.num_kv_heads, d),
            cos,
            sin,
            norm_weight=layer.k_norm,
            eps=sh.eps,
            unit_offset=uo,
            backend="cpu",
        )
        v = v.view(rows, SHAPE.num_kv_heads, d)
        backend.reshape_and_cache(k, v, layer.k_cache, layer.v_cache, case.slots[layer.group])
        starts = (
            torch.arange(case.lens.numel() + 1, dtype=torch.int32) if case.starts is None else case.starts
        )
        att = backend.paged_prefill_attention(
            q,
            layer.k_cache,
            layer.v_cache,
            case.tables[layer.group],
            starts,
            case.lens,
            sh.scale,
            sliding_window=layer.sliding_window,
            logit_softcap=sh.logit_softcap,
        )
        x, normed = fused.add_rms_norm(
            matmul(att.reshape(rows, Q), layer.o),
            x,
            layer.mlp_norm,
            sh.eps,
            unit_offset=uo,
            pre_weight=layer.attn_out_norm,
            backend="cpu",
        )
        mlp = matmul(
            fused.act_and_mul(matmul(normed, layer.gate_up), sh.activation, backend="cpu"), layer.down
        )
        if layer.mlp_out_norm is not None:
            mlp = fused.rms_norm(mlp, layer.mlp_out_norm, sh.eps, unit_offset=uo, backend="cpu")
        x = x + mlp
    return x


def with_fresh_caches(case: Case) -> Case:
    """The same case over copies of its caches (each side writes its own)."""
    layers = [
        replace(layer, k_cache=layer.k_cache.clone(), v_cache=layer.v_cache.clone()) for layer in case.layers
    ]
    return replace(case, layers=layers, x=case.x.clone())


def native(
    case: Case,
    dtype: torch.dtype,
    kernels: cpu_decode.DecodeKernels | None = None,
    *,
    num_threads: int | None = None,
    prefetch: bool = True,
) -> Tensor:
    """The native call's output (and its cache writes, into the case's caches)."""
    stack = DecodeStack(case.layers, case.shape, dtype)
    if kernels is not None:
        stack.lib = kernels
    x = case.x.clone()
    stack.run(
        x,
        case.cos,
        case.sin,
        case.slots,
        case.tables,
        case.lens,
        num_threads,
        prefetch,
        query_start_loc=case.starts,
    )
    return x


def assert_same(got: Tensor, want: Tensor) -> None:
    """Bitwise equal, NaN where NaN."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0)), (got - want).abs().max()


def assert_native_is_the_ops(case: Case, dtype: torch.dtype, threads: Sequence[int]) -> None:
    """The native call's output and cache writes bitwise the op chain's, on each thread count (prefetching on 2)."""
    ref_case = with_fresh_caches(case)
    want = reference(ref_case)
    assert not want.isnan().any()
    for count in threads:
        got_case = with_fresh_caches(case)
        assert_same(native(got_case, dtype, num_threads=count, prefetch=count == 2), want)
        for mine, theirs in zip(got_case.layers, ref_case.layers, strict=True):
            assert_same(mine.k_cache, theirs.k_cache)  # the NaN slots left alone, the new rows written
            assert_same(mine.v_cache, theirs.v_cache)


# Context lengths: the first token of a sequence, ends and starts of blocks, past the sliding window.
LENS = (1, 4, 5, 9, 12, 30)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_native_layers_equal_the_ops_bitwise(rows: int, dtype: torch.dtype, arch: str) -> None:
    """Outputs and written K/V rows are bitwise the op-by-op chain's, for 1-4 rows, on 1, 2 and 3 threads, for
    Llama's layer, Qwen 3's (q/k norms) and Gemma 3's. (On 3 threads one or two rows' 2 or 4 (row, KV head) items
    would leave a thread idle: the step cuts each KV head's query heads into items of their own.)"""
    c_kernel_or_skip(lambda: cpu_decode.kernels(dtype))
    for seed, lens in enumerate([LENS[-rows:], LENS[:rows][::-1]]):
        case = make_case(rows, dtype, seed, lens, gemma=arch == "gemma3", qk_norms=arch == "qwen3")
        assert_native_is_the_ops(case, dtype, threads=(1, 2, 3))


# A speculative step's shapes: one sequence's token and 4 drafts; several sequences with drafts beside plain
# decode rows; the GEMV's most rows (16) in one call. Context lengths cross blocks and the sliding window (6).
MULTI = [((5,), (12,)), ((3, 1, 5), (9, 4, 30)), ((1, 8, 2, 5), (5, 12, 2, 9))]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("q_lens", "lens"), MULTI)
def test_several_tokens_per_sequence_equal_the_ops_bitwise(
    q_lens: tuple[int, ...], lens: tuple[int, ...], dtype: torch.dtype, arch: str
) -> None:
    """Sequences with several new tokens (attended causally among themselves, in the prefill kernel's items):
    outputs and written K/V rows bitwise the op-by-op chain's, on 1 and 2 threads."""
    c_kernel_or_skip(lambda: cpu_decode.kernels(dtype))
    case = make_case(
        len(q_lens), dtype, 7, lens, gemma=arch == "gemma3", qk_norms=arch == "qwen3", q_lens=q_lens
    )
    assert case.x.shape[0] == sum(q_lens) <= cpu_decode.MAX_ROWS
    assert_native_is_the_ops(case, dtype, threads=(1, 2))


# Past the GEMV's 16 rows: one token for each of 17 or 24 sequences (every (row, KV head) item at once), and
# sequences of several tokens (17 rows; 40, with a chunk of 17 tokens of one sequence).
WIDE = [((1,) * 17, None), ((1,) * 24, None), ((16, 1), (30, 5)), ((17, 1, 9, 13), (30, 5, 12, 20))]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("q_lens", "lens"), WIDE)
def test_rows_past_the_gemv_equal_the_ops_bitwise(
    q_lens: tuple[int, ...], lens: tuple[int, ...] | None, dtype: torch.dtype, arch: str
) -> None:
    """From 17 rows the ops multiply a row-major weight on the vector unit (bfloat16 pairs or float32) and a
    repacked one on its int8 tiles, in one weight where its runs mix them: the native call does the same, bitwise,
    on 1 and 2 threads."""
    c_kernel_or_skip(lambda: cpu_decode.kernels(dtype))
    context = lens if lens is not None else [LENS[i % len(LENS)] for i in range(len(q_lens))]
    case = make_case(len(q_lens), dtype, 11, context, gemma=arch == "gemma3", q_lens=q_lens)
    assert cpu_quant.GEMV_MAX_ROWS < case.x.shape[0] <= cpu_decode.MAX_ROWS
    assert_native_is_the_ops(case, dtype, threads=(1, 2))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_final_norm_in_the_call_is_the_norm_op(dtype: torch.dtype, arch: str) -> None:
    """With `final_norm` the call writes the last layer's output normed, bitwise the fused rms_norm op on it
    (Llama's w * x_hat and Gemma's (1 + w) form), leaving the caches as without it; a weight of another size or
    dtype is refused by name before anything runs."""
    c_kernel_or_skip(lambda: cpu_decode.kernels(dtype))
    case = make_case(3, dtype, 5, LENS[:3], gemma=arch == "gemma3")
    weight = (torch.randn(case.shape.hidden, generator=torch.Generator().manual_seed(9)) * 0.5).to(dtype)
    plain = native(with_fresh_caches(case), dtype)
    stack = DecodeStack(case.layers, case.shape, dtype)
    normed_case = with_fresh_caches(case)
    x = normed_case.x.clone()
    args = (case.cos, case.sin, case.slots, case.tables, case.lens)
    stack.run(x, *args, query_start_loc=case.starts, final_norm=weight)
    uo = case.shape.unit_offset
    assert_same(x, fused.rms_norm(plain, weight, case.shape.eps, unit_offset=uo, backend="cpu"))
    for bad in (weight[:-1], weight.to(torch.float16)):
        with pytest.raises(ValueError, match="final_norm must be a contiguous"):
            stack.run(x.clone(), *args, query_start_loc=case.starts, final_norm=bad)


def test_max_rows_in_one_call_and_the_c_file_refuses_more(monkeypatch: pytest.MonkeyPatch) -> None:
    """MAX_ROWS rows in one call equal the op-by-op chain; one more row, let past the Python check, the C file
    refuses itself: its DECODE_MAX_ROWS is the same number."""
    c_kernel_or_skip(lambda: cpu_decode.kernels(torch.float32))
    half = cpu_decode.MAX_ROWS // 2
    case = make_case(2, torch.float32, 9, (30, 12), q_lens=(cpu_decode.MAX_ROWS - half, half))
    assert case.x.shape[0] == cpu_decode.MAX_ROWS
    want = reference(with_fresh_caches(case))
    assert_same(native(with_fresh_caches(case), torch.float32), want)
    over = make_case(2, torch.float32, 9, (30, 12), q_lens=(cpu_decode.MAX_ROWS - half + 1, half))
    monkeypatch.setattr(cpu_decode, "MAX_ROWS", cpu_decode.MAX_ROWS + 1)
    with pytest.raises(ValueError, match="refused"):
        native(over, torch.float32)


def test_query_start_loc_must_cover_the_rows() -> None:
    """Starts that do not end at the row count, or a sequence without a row, are refused before anything runs."""
    c_kernel_or_skip(lambda: cpu_decode.kernels(torch.float32))
    case = make_case(2, torch.float32, 5, (9, 12), q_lens=(2, 3))
    for starts in ([0, 2, 4], [0, 0, 5], [1, 2, 5]):
        bad = replace(with_fresh_caches(case), starts=torch.tensor(starts, dtype=torch.int32))
        with pytest.raises(ValueError, match="refused"):
            native(bad, torch.float32)


def test_negative_slot_is_not_written() -> None:
    """A row whose slot is negative (padding) writes no cache row, as reshape_and_cache skips it."""
    case = make_case(2, torch.float32, 3, (5, 9))
    case.slots[0, 1] = -1
    before = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in case.layers]
    native(case, torch.float32)
    for layer, (k, v) in zip(case.layers, before, strict=True):
        changed = (layer.k_cache.nan_to_num(7.0) != k.nan_to_num(7.0)).any(dim=(1, 2, 3)).nonzero().flatten()
        assert changed.tolist() == [int(case.tables[0, 0, 1])]  # only row 0's slot (its second block)
        assert torch.equal(layer.v_cache.isnan().sum(), v.isnan().sum() - KV)


# Other -march targets: the same source built for AVX2 (x86-64-v3) and for no vector extension at all (x86-64).
# Their attention sums in another order than this CPU's build, so a case whose attention is exact on every path
# (each sequence's first token: one key, softmax weight exactly 1) isolates the GEMV, norm, rotary and activation
# code, which rounds identically on every path: bitwise equal to the native build.
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_other_targets_build_and_equal_the_native_build(march: str, dtype: torch.dtype) -> None:
    """A compile error fails here (never a skip: only a missing compiler skips)."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 target flags")
    if march == "x86-64-v3" and "avx2" not in cpu_flags():
        pytest.skip("this CPU cannot run an AVX2 build")
    flags = for_march(cpu_decode.CFLAGS, march)
    c_kernel_or_skip(lambda: cpu_decode.kernels(dtype))
    other = cpu_decode.load(cpu_decode.build(dtype, flags))
    case = make_case(3, dtype, 5, (1, 1, 1), gemma=dtype == torch.bfloat16)
    want = native(with_fresh_caches(case), dtype)
    got = native(with_fresh_caches(case), dtype, kernels=other)
    assert_same(got, want)


def test_a_source_that_does_not_compile_raises_compile_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The build reports the compiler's failure as CompileError (which tests see as a failure, not a skip)."""
    from pagoda.pagedkernel import cbuild

    c_kernel_or_skip(lambda: cpu_decode.kernels(torch.float32))
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path))
    real = csrc.read_source
    monkeypatch.setattr(
        csrc, "read_source", lambda name, directory=None: real(name, directory) + "\n#error broken\n"
    )
    with pytest.raises(cbuild.CompileError, match="broken"):
        cpu_decode.build(torch.float32)
