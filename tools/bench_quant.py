"""Quantized matmul benchmark: `qmatmul` on GGUF weights against the memory bandwidth and dense torch.matmul.

For each shape (default: Gemma 3 270M's LM head, 262,144 x 640, and its layers: gate/up 2,048 x 640 and down
640 x 2,048; N x K), each format whose block divides K (the K-quants need K % 256 == 0, which is why the model
stores its 640-wide matrices as Q5_0 and Q8_0) and each batch size (rows of x, default 1, 4, 16, 64, 256), best
of --repeats after a warm-up:
- qmatmul: the cpu backend with float32 x (int8 dot products up to 16 rows; above, W dequantized a panel at a time
  into cache and multiplied on the vector unit, or, from 512 rows of a weight small enough, dequantized whole and
  multiplied by torch's matmul), in ms and in GB/s of weight bytes read (the quantized bytes over the time);
- bf16 x: qmatmul with bfloat16 activations (the int8 kernel for few rows; from 6 rows the AMX kernel where the
  CPU has one, else above 16 rows the vector kernel, in AVX-512 BF16 pairs where the CPU has those);
- deq+mm: dequantize the whole weight (cpu backend), then torch.matmul in float32: what the tiles must beat;
- bf16, f32: dense torch.matmul with the dequantized weight held in bfloat16 / float32, x in the same dtype;
- packed, packed f32: what the engine's dense path runs, oneDNN's linear on the bfloat16 / float32 weight packed
  once for this batch size (`_reorder_linear_weight`, as `--quantization none` holds it; blank where torch has no
  oneDNN), and `bf16 x` / `qmatmul` against it.
A bandwidth probe (`sum` of a float32 tensor as large as the biggest dense weight) is printed in the header and
each qmatmul's GB/s is shown as a share of it. The machine may be shared: compare ratios from one run, and
prefer --threads 1 there (two OpenMP threads wait on each other whenever either is descheduled).

    python tools/bench_quant.py [--formats Q4_0 Q8_0] [--rows 1 16] [--shape lm_head=262144x640] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from pagoda.pagedkernel.cbuild import cpu_name
from pagoda.pagedkernel.quant import (
    BLOCK_SIZES,
    GGMLType,
    QuantizedTensor,
    cpu_quant,
    dequantize,
    ggml_type,
    qmatmul,
)
from pagoda.pagedkernel.quant.testing import random_weight
from torch import Tensor
from tqdm import tqdm

SHAPES = ("lm_head=262144x640", "gate_up=2048x640", "down=640x2048")
FORMATS = ("Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K")  # the default model's four types, and Q4_0
ROWS = (1, 4, 16, 64, 256)


@dataclass(frozen=True, slots=True)
class Point:
    """One measured (shape, format, rows) point: milliseconds of each system."""

    shape: str
    n: int
    k: int
    format: str
    rows: int
    weight_bytes: int
    qmatmul_ms: float
    qmatmul_bf16_ms: float
    deq_mm_ms: float
    bf16_ms: float
    f32_ms: float
    packed_ms: float | None = None
    packed_f32_ms: float | None = None


def packed_linear(x: Tensor, dense: Tensor) -> Callable[[], object] | None:
    """oneDNN's linear on `dense` packed for x's batch size (the engine's dense path in that dtype); None where
    torch lacks those ops, or for bfloat16 where the CPU lacks oneDNN's bfloat16 path (AVX2 only: its reorder
    raises)."""
    mkldnn = torch.ops.mkldnn
    if not (torch._C._has_mkldnn and hasattr(mkldnn, "_reorder_linear_weight")):
        return None
    if dense.dtype == torch.bfloat16 and not mkldnn._is_mkldnn_bf16_supported():
        return None
    packed = mkldnn._reorder_linear_weight(dense, x.shape[0])
    return functools.partial(mkldnn._linear_pointwise, x, packed, None, "none", [], "")


def best_ms(fn: Callable[[], object], repeats: int, budget_s: float = 2.0) -> float:
    """Best wall time of fn() in milliseconds, after one warm-up call (the best, not the median: on a shared
    machine every slower call is another process's time); fewer repeats (at least one) once the measured calls
    have taken `budget_s` (the 256-row LM head calls take about a second each)."""
    fn()
    times: list[float] = []
    while len(times) < repeats and (not times or sum(times) < budget_s * 1e3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def parse_shape(text: str) -> tuple[str, int, int]:
    """'name=NxK' (or 'NxK') as (name, N, K)."""
    name, _, dims = text.rpartition("=")
    n, k = (int(d) for d in dims.lower().split("x"))
    return name or dims, n, k


def probe_gbps(numel: int, repeats: int) -> float:
    """Read bandwidth in GB/s: torch's sum over a float32 tensor of `numel` elements."""
    data = torch.ones(numel)
    ms = best_ms(lambda: data.sum(), repeats)
    return numel * 4 / ms / 1e6


def dequantize_then_matmul(x: Tensor, weight: QuantizedTensor) -> Tensor:  # float32 [rows, N]
    """The whole weight dequantized (cpu backend), then torch's float32 matmul: the baseline for many rows."""
    return x @ dequantize(weight, backend="cpu").t()


def measure(
    name: str, n: int, k: int, formats: Sequence[str], rows: Sequence[int], repeats: int
) -> list[Point]:
    """Every point of one shape; the dense references are timed once per batch size, on the first format."""
    g = torch.Generator().manual_seed(n * 31 + k)
    usable = [f for f in formats if k % BLOCK_SIZES[ggml_type(f)][0] == 0]
    if not usable:
        return []
    weights = {f: random_weight(ggml_type(f), (n, k), g) for f in usable}
    dense32 = dequantize(weights[usable[0]])
    dense16 = dense32.to(torch.bfloat16)
    points = []
    for r in rows:
        x = torch.randn(r, k, generator=g)
        x16 = x.to(torch.bfloat16)
        bf16_ms = best_ms(functools.partial(torch.matmul, x16, dense16.t()), repeats)
        f32_ms = best_ms(functools.partial(torch.matmul, x, dense32.t()), repeats)
        engine, engine32 = packed_linear(x16, dense16), packed_linear(x, dense32)
        packed_ms = best_ms(engine, repeats) if engine is not None else None
        packed_f32_ms = best_ms(engine32, repeats) if engine32 is not None else None
        for f in usable:
            w = weights[f]
            q_ms = best_ms(functools.partial(qmatmul, x, w, backend="cpu"), repeats)
            q16_ms = best_ms(functools.partial(qmatmul, x16, w, backend="cpu"), repeats)
            d_ms = best_ms(functools.partial(dequantize_then_matmul, x, w), repeats)
            points.append(
                Point(
                    name, n, k, f, r, w.nbytes, q_ms, q16_ms, d_ms, bf16_ms, f32_ms, packed_ms, packed_f32_ms
                )
            )
    return points


def format_table(points: Sequence[Point], probe: float) -> str:
    """One line per point: qmatmul's ms, GB/s and share of the probe, beside deq+mm and the dense matmuls."""
    header = (
        f"{'shape':18} {'format':6} {'rows':>4} {'qmatmul ms':>10} {'GB/s':>6} {'of probe':>8} {'bf16 x ms':>9} "
        f"{'deq+mm ms':>9} {'bf16 ms':>8} {'f32 ms':>8} {'vs bf16':>7} {'vs f32':>7} {'packed':>8} {'bf16 x vs':>9} "
        f"{'packed f32':>10} {'q vs':>7}"
    )
    lines = [header, "-" * len(header)]
    for p in points:
        gbps = p.weight_bytes / p.qmatmul_ms / 1e6
        shape = f"{p.shape} {p.n}x{p.k}"
        lines.append(
            f"{shape:18} {p.format:6} {p.rows:4d} {p.qmatmul_ms:10.2f} {gbps:6.1f} {gbps / probe:8.0%} "
            f"{p.qmatmul_bf16_ms:9.2f} "
            f"{p.deq_mm_ms:9.2f} {p.bf16_ms:8.2f} {p.f32_ms:8.2f} {p.bf16_ms / p.qmatmul_ms:6.2f}x "
            f"{p.f32_ms / p.qmatmul_ms:6.2f}x "
            + (
                f"{p.packed_ms:8.2f} {p.packed_ms / p.qmatmul_bf16_ms:8.2f}x"
                if p.packed_ms is not None
                else f"{'':8} {'':9}"
            )
            + (
                f" {p.packed_f32_ms:10.2f} {p.packed_f32_ms / p.qmatmul_ms:6.2f}x"
                if p.packed_f32_ms is not None
                else ""
            )
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, measure every point, print the table (and write the JSON)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", nargs="+", default=list(SHAPES), help="name=NxK (weight rows x columns)")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=[t.name for t in GGMLType])
    parser.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, help="torch's (and the C kernel's) thread count; default: torch's"
    )
    parser.add_argument("--json", type=Path, help="also write the points here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = [parse_shape(s) for s in args.shape]
    probe = probe_gbps(max(n * k for _, n, k in shapes), args.repeats)
    points = []
    for name, n, k in tqdm(shapes, desc="bench_quant", file=sys.stderr):
        points.extend(measure(name, n, k, args.formats, args.rows, args.repeats))
    lib = cpu_quant.kernels()
    amx = "with" if lib.matmul_amx is not None else "without"
    pairs = "with" if lib.matmul_dpbf16 is not None else "without"
    print(
        f"{cpu_name()}, {torch.get_num_threads()} threads, kernel path {lib.path.name} {amx} the AMX matmul, "
        f"{pairs} the AVX-512 BF16 one, probe (float32 sum) {probe:.1f} GB/s, best of {args.repeats}"
    )
    print(format_table(points, probe))
    if args.json:
        args.json.write_text(
            json.dumps({"probe_gbps": probe, "points": [asdict(p) for p in points]}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
