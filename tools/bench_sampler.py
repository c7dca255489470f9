"""Sampler microbenchmark: the fused sampling op against the memory floor, on the CPU, in one run.

For rows {1, 8, 64, 256} x vocab {32k, 152k, 262k} (bfloat16 logits by default) it times, median of --repeats
after a warm-up:
- amax: `logits.amax(-1)`, one read of the logits (the floor the issue measures against);
- greedy: the cpu backend at temperature 0 (its own floor: the same read, in C);
- cpu: the fused op's cpu backend (C) at the --setting's parameters;
- torch: the torch backend (the specification) at the same parameters;
- server: pagoda.server's Sampler (penalty stage, parameter tensors, then the fused op) at the same parameters;
and prints each with its ratio to amax (and cpu's to greedy). Settings: t1 (temperature 1.0, what OpenAI clients
send by default), topp (0.8 and top_p 0.95), topk (top_k 50), minp (min_p 0.05), greedy.

The default logits are LLM-like: N(0, 5^2) with 64 tokens up to 4 nats above the bulk maximum, so that about
6,000 tokens lie within 17 nats of the maximum, 50,000 within 23 and the 0.95 nucleus holds ~50 (Gemma 3 270M's
logits, measured at T = 1: 7,800, 54,000 and 57). --logits-file takes real ones ([n, vocab] saved with torch.save;
rows repeat, columns are cut to each vocabulary size). The machine may be shared: compare the ratios.

    python tools/bench_sampler.py [--setting t1 topp] [--rows 64] [--vocab 262144] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from pagoda.pagedkernel.cbuild import cpu_name
from pagoda.pagedkernel.sampling import SamplingTensors, get_sampler, rng_key
from torch import Tensor
from tqdm import tqdm

SETTINGS: dict[str, dict[str, float]] = {
    "t1": {"temperature": 1.0},
    "topp": {"temperature": 0.8, "top_p": 0.95},
    "topk": {"temperature": 1.0, "top_k": 50},
    "minp": {"temperature": 1.0, "min_p": 0.05},
    "greedy": {"temperature": 0.0},
}
ROWS = (1, 8, 64, 256)
VOCABS = (32_768, 151_936, 262_144)
SYSTEMS = ("amax", "greedy", "cpu", "torch", "server")


@dataclass(frozen=True, slots=True)
class Point:
    """One measured (setting, rows, vocab) point: milliseconds per system, None where skipped or failed."""

    setting: str
    rows: int
    vocab: int
    ms: dict[str, float | None]


def make_logits(rows: int, vocab: int, dtype: torch.dtype, source: Tensor | None, seed: int) -> Tensor:
    """[rows, vocab] logits: LLM-like synthetic ones, or rows of `source` (cycled, cut to vocab)."""
    if source is not None:
        index = torch.arange(rows) % source.shape[0]
        return source[index, :vocab].to(dtype).contiguous()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 5.0
    spikes = torch.randint(0, vocab, (rows, 64), generator=g)
    lift = x.amax(dim=-1, keepdim=True) + 4.0 * torch.rand(rows, 64, generator=g) ** 2
    return x.scatter_(1, spikes, lift).to(dtype)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of fn() in milliseconds, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def server_sampler(setting: dict[str, float], rows: int) -> Callable[[Tensor], object] | None:
    """pagoda.server's Sampler at the setting, or None when the server package is not importable."""
    try:
        from pagoda.server.sampling.records import SamplingRow
        from pagoda.server.sampling.sampler import Sampler
        from pagoda.server.sampling_params import SamplingParams
    except ImportError:
        return None
    top_k = setting.get("top_k")
    params = SamplingParams(
        temperature=setting["temperature"],
        top_p=setting.get("top_p", 1.0),
        top_k=None if top_k is None else int(top_k),
        min_p=setting.get("min_p", 0.0),
    )
    batch = [SamplingRow(params, (), (), seed, 0, ()) for seed in range(rows)]
    sampler = Sampler()
    return lambda logits: sampler(logits, batch)


def measure(
    setting_name: str,
    rows: int,
    vocab: int,
    logits: Tensor,
    repeats: int,
    max_reference: int,
) -> Point:
    """Time every system on one tensor of logits."""
    setting = SETTINGS[setting_name]
    top_k = setting.get("top_k")

    def params(temperature: float) -> SamplingTensors:
        return SamplingTensors.build(
            temperature=[temperature] * rows,
            keys=[rng_key(0, 0, i) for i in range(rows)],
            top_k=[None if top_k is None else int(top_k)] * rows,
            top_p=[setting.get("top_p", 1.0)] * rows,
            min_p=[setting.get("min_p", 0.0)] * rows,
        )

    sampled, greedy = params(setting["temperature"]), params(0.0)
    cpu, reference = get_sampler("cpu"), get_sampler("torch")
    server = server_sampler(setting, rows)
    ms: dict[str, float | None] = {
        "amax": median_ms(lambda: logits.amax(dim=-1), repeats),
        "greedy": median_ms(lambda: cpu(logits, greedy), repeats),
        "cpu": median_ms(lambda: cpu(logits, sampled), repeats),
        "torch": None,
        "server": None,
    }
    if rows * vocab <= max_reference:
        ms["torch"] = median_ms(lambda: reference(logits, sampled), repeats)
        if server is not None:
            ms["server"] = median_ms(lambda: server(logits), repeats)
    return Point(setting_name, rows, vocab, ms)


def format_table(points: Sequence[Point]) -> str:
    """One line per point: each system's time and its ratio to amax; cpu's ratio to greedy."""

    def cell(ms: float | None, floor: float) -> str:
        return "-" if ms is None else f"{ms:8.2f} ({ms / floor:5.2f}x)"

    header = (
        f"{'setting':7} {'rows':>5} {'vocab':>7} " + " ".join(f"{s:>17}" for s in SYSTEMS) + "  cpu/greedy"
    )
    lines = [header, "-" * len(header)]
    for p in points:
        floor = p.ms["amax"] or 1.0
        cells = " ".join(f"{cell(p.ms[s], floor):>17}" for s in SYSTEMS)
        ratio = (p.ms["cpu"] or 0.0) / (p.ms["greedy"] or 1.0)
        lines.append(f"{p.setting:7} {p.rows:5d} {p.vocab:7d} {cells}  {ratio:9.2f}x")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, measure every point, print the table (and write the JSON)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--setting", nargs="+", choices=sorted(SETTINGS), default=["t1"])
    parser.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    parser.add_argument("--vocab", nargs="+", type=int, default=list(VOCABS))
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, help="torch's (and the C kernel's) thread count; default: torch's"
    )
    parser.add_argument(
        "--max-reference",
        type=int,
        default=64 * 262_144,
        help="skip the torch and server samplers above this many logits (they take seconds there)",
    )
    parser.add_argument("--logits-file", type=Path, help="real logits [n, vocab] saved with torch.save")
    parser.add_argument("--json", type=Path, help="also write the points here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    source = torch.load(args.logits_file) if args.logits_file else None
    grid = [(s, r, v) for s in args.setting for v in args.vocab for r in args.rows]
    points = []
    for setting, rows, vocab in tqdm(grid, desc="bench_sampler", file=sys.stderr):
        logits = make_logits(rows, vocab, dtype, source, seed=rows * 7919 + vocab)
        points.append(measure(setting, rows, vocab, logits, args.repeats, args.max_reference))
    print(
        f"{cpu_name()}, {torch.get_num_threads()} threads, {args.dtype} logits, median of {args.repeats} (ms)"
    )
    print(format_table(points))
    if args.json:
        args.json.write_text(json.dumps([asdict(p) for p in points], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
