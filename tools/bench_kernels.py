"""Paged-attention kernel benchmark: each available backend against the device's copy bandwidth, in one run.

On CUDA: decode at batch {64, 256} x context {1k, 4k, 16k} and a 4k-token prefill with Llama-3-8B's attention
shape (32 query heads, 8 KV heads, head_dim 128, bfloat16, blocks of 16), for every available backend (torch,
triton, cupy). On the CPU: the torch and cpu backends with the default model's attention shape (Gemma 3 270M: 4
query heads, 1 KV head, head_dim 256, float32). Each row reports the median time, the achieved bandwidth (bytes of
K/V read + q + out over time) and its ratio to a large device copy measured in the same run.

    python tools/bench_kernels.py [--device cpu|cuda] [--json out.json] [--plot out.png] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from pagoda.pagedkernel import BACKEND_NAMES, BackendUnavailableError, KernelBackend, get_backend
from tqdm import tqdm


@dataclass(frozen=True, slots=True)
class Shape:
    """Attention shape of one model layer and the cache layout."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class Config:
    """One benchmark point: `batch` sequences of `context` tokens, the last `q_len` of each being queries."""

    op: str  # "decode" or "prefill"
    batch: int
    context: int
    q_len: int


@dataclass(frozen=True, slots=True)
class Row:
    """One measured (backend, config) point."""

    op: str
    backend: str
    batch: int
    context: int
    q_len: int
    ms: float | None  # None when the backend failed (see error)
    gb_per_s: float | None
    of_copy: float | None  # achieved bandwidth / copy bandwidth
    tflop_per_s: float | None
    error: str | None  # "OOM", or the exception of a backend that failed on this point


LLAMA3_8B = Shape(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
CUDA_CONFIGS = [Config("decode", b, c, 1) for b in (64, 256) for c in (1024, 4096, 16384)] + [
    Config("prefill", 1, 4096, 4096)
]
# The CPU runs the default model's shape (Gemma 3 270M) in float32 (bfloat16 matmul is slow on AVX2 CPUs).
CPU_SHAPE = Shape(num_heads=4, num_kv_heads=1, head_dim=256, block_size=16, dtype=torch.float32)
CPU_CONFIGS = [Config("decode", b, c, 1) for b in (8, 128) for c in (256, 1024)] + [
    Config("prefill", 1, 512, 512),
    Config("prefill", 4, 512, 512),
]
QUICK_CONFIGS = [Config("decode", 2, 40, 1), Config("prefill", 2, 40, 24)]


def make_inputs(shape: Shape, config: Config, device: torch.device) -> dict[str, torch.Tensor]:
    """Random q and a cache holding exactly the batch's blocks, in shuffled order."""
    blocks_per_seq = -(-config.context // shape.block_size)
    num_blocks = config.batch * blocks_per_seq
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    q_lens = torch.full((config.batch,), config.q_len, dtype=torch.int32)
    return {
        "q": torch.randn(config.batch * config.q_len, shape.num_heads, shape.head_dim, device=device).to(
            shape.dtype
        ),
        "k_cache": torch.randn(cache_shape, device=device).to(shape.dtype),
        "v_cache": torch.randn(cache_shape, device=device).to(shape.dtype),
        "block_tables": torch.randperm(num_blocks, device=device)
        .to(torch.int32)
        .view(config.batch, blocks_per_seq),
        "context_lens": torch.full((config.batch,), config.context, dtype=torch.int32, device=device),
        "query_start_loc": torch.cat(
            [torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0).to(torch.int32)]
        ).to(device),
    }


def attention_call(
    backend: KernelBackend, config: Config, inputs: dict[str, torch.Tensor], scale: float
) -> Callable[[], object]:
    """A closure running the config's op once on `inputs`."""
    i = inputs
    if config.op == "decode":
        return lambda: backend.paged_decode_attention(
            i["q"], i["k_cache"], i["v_cache"], i["block_tables"], i["context_lens"], scale
        )
    return lambda: backend.paged_prefill_attention(
        i["q"], i["k_cache"], i["v_cache"], i["block_tables"], i["query_start_loc"], i["context_lens"], scale
    )


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall time of `fn` in milliseconds (CUDA: triton.testing.do_bench or CUDA events)."""
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            return _cuda_event_ms(fn, repeats)
        return float(do_bench(fn, warmup=25, rep=max(100, 10 * repeats), return_mode="median"))
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _cuda_event_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median of CUDA-event timings, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        stop = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(float(start.elapsed_time(stop)))
    return statistics.median(times)


def copy_bandwidth(device: torch.device, repeats: int, nbytes: int) -> float:
    """GB/s of a large same-device copy, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, repeats)
    return 2 * nbytes / ms / 1e6


def traffic(shape: Shape, config: Config) -> tuple[int, float]:
    """(bytes of K/V read + q read + out written, attention FLOPs counting only visible pairs)."""
    elt = torch.empty((), dtype=shape.dtype).element_size()
    kv = 2 * config.batch * config.context * shape.num_kv_heads * shape.head_dim * elt
    q_and_out = 2 * config.batch * config.q_len * shape.num_heads * shape.head_dim * elt
    # Query r of q_len sees context - q_len + r + 1 keys.
    pairs = config.q_len * (config.context - config.q_len) + config.q_len * (config.q_len + 1) / 2
    return kv + q_and_out, 4.0 * config.batch * pairs * shape.num_heads * shape.head_dim


def available_backends(device: torch.device, wanted: list[str]) -> list[KernelBackend]:
    """The wanted backends that can run on `device` (the CPU: torch and cpu, Triton's interpreter is not timed)."""
    found = []
    for name in wanted:
        runs_here = name == "torch" or (name == "cpu") == (device.type == "cpu")
        if not runs_here:
            continue
        try:
            found.append(get_backend(name, device))
        except BackendUnavailableError as exc:
            print(f"skipping {name}: {exc}", file=sys.stderr)
    return found


def run(
    device: torch.device, configs: list[Config], shape: Shape, wanted: list[str], repeats: int
) -> tuple[list[Row], float]:
    """Measure every (backend, config); returns the rows and the copy bandwidth in GB/s."""
    copy_gbps = copy_bandwidth(device, repeats, (1 << 30) if device.type == "cuda" else (256 << 20))
    backends = available_backends(device, wanted)
    rows = []
    scale = shape.head_dim**-0.5
    with tqdm(total=len(configs) * len(backends), desc="kernels", file=sys.stderr) as bar:
        for config in configs:
            inputs = make_inputs(shape, config, device)
            nbytes, flops = traffic(shape, config)
            for backend in backends:
                bar.set_postfix_str(f"{backend.name} {config.op} b={config.batch} ctx={config.context}")
                ms: float | None = None
                error = None
                try:
                    ms = median_ms(attention_call(backend, config, inputs, scale), device, repeats)
                except torch.OutOfMemoryError:
                    error = "OOM"
                    torch.cuda.empty_cache()
                except Exception as exc:  # one failing backend must not hide the others' numbers
                    error = f"{type(exc).__name__}: {exc}"
                    print(f"{backend.name} failed on {config}: {error}", file=sys.stderr)
                gbps = None if ms is None else nbytes / ms / 1e6
                rows.append(
                    Row(
                        op=config.op,
                        backend=backend.name,
                        batch=config.batch,
                        context=config.context,
                        q_len=config.q_len,
                        ms=ms,
                        gb_per_s=gbps,
                        of_copy=None if gbps is None else gbps / copy_gbps,
                        tflop_per_s=None if ms is None else flops / ms / 1e9,
                        error=error,
                    )
                )
                bar.update()
            del inputs
    return rows, copy_gbps


def format_table(rows: list[Row], copy_gbps: float, device: torch.device) -> str:
    """A plain-text table of the rows, with the copy bandwidth they are compared against."""

    def cell(value: float | None, fmt: str, error: str | None) -> str:
        return ("OOM" if error == "OOM" else "ERR") if value is None else format(value, fmt)

    lines = [
        f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else f'cpu, {torch.get_num_threads()} threads'}; "
        f"copy bandwidth (read + write): {copy_gbps:.1f} GB/s",
        f"{'op':<8} {'backend':<7} {'batch':>5} {'context':>7} {'q_len':>5} {'ms':>9} {'GB/s':>8} "
        f"{'of copy':>7} {'TFLOP/s':>8}",
    ]
    for r in rows:
        lines.append(
            f"{r.op:<8} {r.backend:<7} {r.batch:>5} {r.context:>7} {r.q_len:>5} {cell(r.ms, '9.3f', r.error):>9} "
            f"{cell(r.gb_per_s, '8.1f', r.error):>8} {cell(r.of_copy, '7.1%', r.error):>7} "
            f"{cell(r.tflop_per_s, '8.3f', r.error):>8}"
        )
    return "\n".join(lines)


def plot(rows: list[Row], copy_gbps: float, path: str) -> None:
    """Grouped bars: each backend's share of the copy bandwidth at every benchmark point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted({(r.op, r.batch, r.context) for r in rows}, key=lambda p: (p[0] != "decode", p[1], p[2]))
    backends = sorted({r.backend for r in rows})
    share = {(r.op, r.batch, r.context, r.backend): r.of_copy or 0.0 for r in rows}
    width = 0.8 / len(backends)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(points)), 4))
    for i, backend in enumerate(backends):
        xs = [j + i * width for j in range(len(points))]
        ax.bar(xs, [100 * share.get((*p, backend), 0.0) for p in points], width, label=backend)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(points))])
    ax.set_xticklabels([f"{op}\nb={b} ctx={c}" for op, b, c in points], fontsize=8)
    ax.set_ylabel(f"% of copy bandwidth ({copy_gbps:.0f} GB/s)")
    ax.set_title("paged attention: bytes of K/V + q + out per second")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the benchmark, print the table (and write JSON when asked)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backends", default=",".join(BACKEND_NAMES), help="comma-separated subset")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="a tiny shape (the smoke test)")
    parser.add_argument("--json", help="also write the rows and the copy bandwidth to this file")
    parser.add_argument(
        "--plot", help="also save a bar chart (PNG) of each backend's share of the copy bandwidth"
    )
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.quick:
        shape = Shape(num_heads=4, num_kv_heads=2, head_dim=16, block_size=8, dtype=torch.float32)
        configs = QUICK_CONFIGS
    elif device.type == "cuda":
        shape, configs = LLAMA3_8B, CUDA_CONFIGS
    else:
        shape, configs = CPU_SHAPE, CPU_CONFIGS
    rows, copy_gbps = run(device, configs, shape, args.backends.split(","), args.repeats)
    print(format_table(rows, copy_gbps, device))
    if args.plot:
        plot(rows, copy_gbps, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": str(device),
                    "copy_gb_per_s": copy_gbps,
                    "shape": {**asdict(shape), "dtype": str(shape.dtype)},
                    "rows": [asdict(r) for r in rows],
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
