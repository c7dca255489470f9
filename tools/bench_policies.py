"""Static vs continuous batching and contiguous vs paged KV, live: one Poisson workload through the real engine.

    .venv/bin/python tools/bench_policies.py                   # Gemma 3 270M, table + out/bench_policies.png
    .venv/bin/python tools/bench_policies.py --num-requests 16 --rate 2 --temperature 0

Systems (same model, same trace, same KV memory, one engine each over the same loaded weights):
  (a) static batching + contiguous reservation of max_model_len per sequence (FasterTransformer-style)
  (b) continuous batching + contiguous reservation (Orca-style)
  (c) continuous batching + paged KV (vLLM)
  (d) (c) plus prefix caching

The trace: Poisson arrivals at `--rate` (inf: all at once), submitted at their wall-clock times with the engine's
`arrival_time`; every prompt starts with one of `--num-system-prompts` shared system prompts; outputs are short
or, with probability `--long-fraction`, long, fixed by `max_tokens` with EOS ignored (every system does the same
work). Sampled at `--temperature` (1.0 by default, the OpenAI default) with a seed per request.

Reported per system: output tokens/s over the makespan, TTFT and TPOT p50/p99, the time-weighted share of
reserved KV slots holding real tokens, and the GPU-idle-equivalent: the time-weighted share of batch seats whose
row did no work in a step (a static batch keeps its finished members' seats until it drains; a contiguous static
batch also keeps seats of members still waiting for a region).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pagoda.scheduler import Scheduler, SchedulerOutput, StaticBatchPolicy
from pagoda.scheduler.testing import kv_occupancy
from pagoda.server.config import EngineConfig, KVManagerName, SchedulingPolicyName
from pagoda.server.engine import LLMEngine
from pagoda.server.engine.setup import EngineParts, build_parts
from pagoda.server.sampling_params import SamplingParams
from tqdm import tqdm


@dataclass(frozen=True)
class System:
    """One policy x KV-reservation combination."""

    key: str
    name: str
    policy: SchedulingPolicyName
    kv_manager: KVManagerName
    prefix_caching: bool


SYSTEMS = (
    System("a", "static + contiguous", "static", "contiguous", False),
    System("b", "continuous + contiguous", "fcfs", "contiguous", False),
    System("c", "continuous + paged", "fcfs", "paged", False),
    System("d", "paged + prefix cache", "fcfs", "paged", True),
)


@dataclass(frozen=True)
class TraceRequest:
    """One request: arrival offset (s), prompt token ids, output length."""

    arrival: float
    prompt: tuple[int, ...]
    output_len: int


def make_trace(args: argparse.Namespace, vocab_size: int) -> list[TraceRequest]:
    """Poisson arrivals, shared system prompts, short or long outputs; fixed by `args.seed`."""
    rng = random.Random(args.seed)

    def tokens(n: int) -> tuple[int, ...]:
        """`n` random ids clear of the low special tokens."""
        return tuple(rng.randrange(8, vocab_size) for _ in range(n))

    systems = [tokens(args.system_prompt_len) for _ in range(args.num_system_prompts)]
    trace, now = [], 0.0
    for _ in range(args.num_requests):
        if math.isfinite(args.rate):
            now += rng.expovariate(args.rate)
        prefix = rng.choice(systems) if systems else ()
        prompt = prefix + tokens(rng.randint(*args.prompt_len))
        lengths = args.long_output if rng.random() < args.long_fraction else args.short_output
        output_len = min(rng.randint(*lengths), args.max_model_len - len(prompt))
        trace.append(TraceRequest(now, prompt, max(1, output_len)))
    return trace


@dataclass
class StepLog:
    """Per-step gauges, each to be weighted by the step's wall time."""

    times: list[float] = field(default_factory=list)  # monotonic time of each schedule()
    seats: list[int] = field(default_factory=list)  # batch seats held
    working: list[int] = field(default_factory=list)  # sequences that computed a chunk
    real: list[int] = field(default_factory=list)  # KV token slots holding real tokens
    reserved: list[int] = field(default_factory=list)  # KV token slots reserved


class RecordingScheduler(Scheduler):
    """The engine's scheduler, logging seats, working rows and KV occupancy at every step."""

    log: StepLog

    def schedule(self) -> SchedulerOutput:
        """Schedule, then log what this step holds and what it uses."""
        out = super().schedule()
        if out.is_empty:
            return out
        working = len(out.scheduled)
        policy = self.policy
        # A static batch holds a seat for every member until it drains, finished or not yet admitted.
        seats = len(policy.batch) if isinstance(policy, StaticBatchPolicy) else len(self.running)
        occupancy = kv_occupancy(self)
        log = self.log
        log.times.append(time.monotonic())
        log.seats.append(max(seats, working))
        log.working.append(working)
        log.real.append(occupancy.real_tokens)
        log.reserved.append(occupancy.reserved_tokens)
        return out


@dataclass
class Result:
    """What one system achieved on the trace."""

    name: str
    makespan_s: float
    output_tokens: int
    ttft: list[float]
    tpot: list[float]
    kv_real: float  # time-weighted real / reserved KV slots
    idle_rows: float  # time-weighted idle seats / seats
    mean_seats: float
    prefix_hit_rate: float
    preemptions: int

    @property
    def throughput(self) -> float:
        """Output tokens per second over the makespan."""
        return self.output_tokens / self.makespan_s if self.makespan_s else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def weighted(log: StepLog, end: float) -> tuple[float, float, float]:
    """(real / reserved KV, idle seats / seats, mean seats), each step weighted by its duration."""
    ends = [*log.times[1:], end]
    durations = [max(0.0, b - a) for a, b in zip(log.times, ends, strict=True)]
    total = sum(durations) or 1.0
    real = sum(d * (r / v if v else 0.0) for d, r, v in zip(durations, log.real, log.reserved, strict=True))
    idle = sum(
        d * (1 - w / s if s else 0.0) for d, w, s in zip(durations, log.working, log.seats, strict=True)
    )
    seats = sum(d * s for d, s in zip(durations, log.seats, strict=True))
    return real / total, idle / total, seats / total


def engine_config(system: System, args: argparse.Namespace) -> EngineConfig:
    """The engine arguments of `system`: same KV memory and limits for all."""
    max_num_seqs = args.max_num_seqs
    if system.policy == "static" and system.kv_manager == "contiguous":
        # As the simulator does: a static batch is as large as the regions that fit (FasterTransformer's batch).
        max_num_seqs = max(1, min(max_num_seqs, args.kv_tokens // args.max_model_len))
    return EngineConfig.from_flat(
        model=args.model,
        max_model_len=args.max_model_len,
        max_num_seqs=max_num_seqs,
        block_size=args.block_size,
        num_kv_blocks=args.kv_tokens // args.block_size,
        enable_prefix_caching=system.prefix_caching,
        scheduling_policy=system.policy,
        static_batch_timeout_s=args.static_timeout,
        kv_manager=system.kv_manager,
        dtype=args.dtype,
        seed=args.seed,
    )


def run_system(
    system: System,
    parts: EngineParts,
    trace: Sequence[TraceRequest],
    args: argparse.Namespace,
    progress: Callable[[int], object],
) -> Result:
    """Submit the trace at its wall-clock arrival times and step the engine until every request finished."""
    engine = LLMEngine(engine_config(system, args), parts)
    old = engine.scheduler
    engine.scheduler = recording = RecordingScheduler(old.config, old.kv, old.policy)
    recording.log = StepLog()
    finished: dict[str, tuple[int, float, float | None, float | None]] = {}
    start = time.monotonic()
    next_index = 0
    while next_index < len(trace) or engine.has_unfinished_requests():
        now = time.monotonic()
        while next_index < len(trace) and start + trace[next_index].arrival <= now:
            t = trace[next_index]
            params = SamplingParams(
                temperature=args.temperature, max_tokens=t.output_len, ignore_eos=True, seed=next_index
            )
            engine.add_request(f"q{next_index}", t.prompt, params, arrival_time=start + t.arrival)
            next_index += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + trace[next_index].arrival - time.monotonic()))
            continue
        for output in engine.step():
            if output.finished:
                m = output.metrics
                n = len(output.outputs[0].token_ids)
                finished[output.request_id] = (n, m.arrival_time, m.first_token_time, m.last_token_time)
                progress(1)
    end = time.monotonic()
    ttft, tpot = [], []
    for n, arrival, first, last in finished.values():
        if first is not None:
            ttft.append(first - arrival)
            if last is not None and n > 1:
                tpot.append((last - first) / (n - 1))
    kv_real, idle, seats = weighted(recording.log, end)
    stats = engine.get_stats()
    queries = stats.prefix_cache_queries
    return Result(
        name=system.name,
        makespan_s=end - start,
        output_tokens=sum(n for n, *_ in finished.values()),
        ttft=ttft,
        tpot=tpot,
        kv_real=kv_real,
        idle_rows=idle,
        mean_seats=seats,
        prefix_hit_rate=stats.prefix_cache_hits / queries if queries else 0.0,
        preemptions=stats.num_preemptions,
    )


def print_table(results: Sequence[Result], trace: Sequence[TraceRequest], args: argparse.Namespace) -> None:
    """The comparison table, throughput relative to (a)."""
    mean_prompt = statistics.fmean(len(t.prompt) for t in trace)
    mean_output = statistics.fmean(t.output_len for t in trace)
    print(
        f"\n{len(trace)} requests at {args.rate}/s (Poisson), mean prompt {mean_prompt:.0f} / output "
        f"{mean_output:.0f} tokens, KV memory {args.kv_tokens} token slots, block size {args.block_size}, "
        f"max_model_len {args.max_model_len}, temperature {args.temperature}"
    )
    print(
        f"{'system':<26}{'out tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}"
        f"{'KV real':>9}{'idle rows':>11}{'seats':>7}{'prefix hit':>12}{'preempt':>9}  vs (a)"
    )
    base = results[0].throughput or 1.0
    for r in results:
        print(
            f"{r.name:<26}{r.throughput:>10.1f}{percentile(r.ttft, 0.5):>9.2f}s{percentile(r.ttft, 0.99):>9.2f}s"
            f"{percentile(r.tpot, 0.5) * 1e3:>8.0f}ms{percentile(r.tpot, 0.99) * 1e3:>8.0f}ms"
            f"{r.kv_real:>9.1%}{r.idle_rows:>11.1%}{r.mean_seats:>7.1f}{r.prefix_hit_rate:>12.1%}"
            f"{r.preemptions:>9}  {r.throughput / base:.2f}x"
        )


def plot(results: Sequence[Result], out: str) -> None:
    """Throughput, TTFT, KV real share and idle rows, one bar per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name for r in results]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    axes[0][0].bar(names, [r.throughput for r in results], color="tab:blue")
    axes[0][0].set_ylabel("output tokens / s")
    axes[0][1].bar(names, [percentile(r.ttft, 0.5) for r in results], color="tab:orange", label="p50")
    axes[0][1].plot(names, [percentile(r.ttft, 0.99) for r in results], "k^", label="p99")
    axes[0][1].set_ylabel("TTFT (s)")
    axes[0][1].legend()
    axes[1][0].bar(names, [r.kv_real for r in results], color="tab:green")
    axes[1][0].set_ylabel("KV slots holding real tokens / reserved")
    axes[1][0].set_ylim(0, 1.05)
    axes[1][1].bar(names, [r.idle_rows for r in results], color="tab:red")
    axes[1][1].set_ylabel("batch seats doing no work (GPU-idle-equivalent)")
    axes[1][1].set_ylim(0, 1.05)
    for row in axes:
        for ax in row:
            ax.tick_params(axis="x", labelsize=8, rotation=15)
    fig.suptitle(
        "Real engine, same trace and KV memory: static vs continuous batching, contiguous vs paged KV"
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"plot written to {out}")


def length_range(text: str) -> tuple[int, int]:
    """`LO-HI` (inclusive) as a pair."""
    lo, _, hi = text.partition("-")
    low, high = int(lo), int(hi or lo)
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"not a range LO-HI with 1 <= LO <= HI: {text!r}")
    return low, high


def build_arg_parser() -> argparse.ArgumentParser:
    """The bench's options."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m", help="HF folder, .gguf or packaged short name")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument(
        "--rate", type=float, default=1.0, help="Poisson arrivals per second (inf: all at once)"
    )
    parser.add_argument("--prompt-len", type=length_range, default=(16, 96), help="user prompt tokens LO-HI")
    parser.add_argument("--short-output", type=length_range, default=(8, 32), help="short outputs LO-HI")
    parser.add_argument("--long-output", type=length_range, default=(128, 192), help="long outputs LO-HI")
    parser.add_argument("--long-fraction", type=float, default=0.25, help="share of long outputs")
    parser.add_argument("--system-prompt-len", type=int, default=64)
    parser.add_argument("--num-system-prompts", type=int, default=2)
    parser.add_argument("--kv-tokens", type=int, default=4096, help="KV memory of every system, token slots")
    parser.add_argument("--max-model-len", type=int, default=512, help="a contiguous region's size")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--static-timeout", type=float, default=1.0, help="static batching: longest wait (s)")
    parser.add_argument("--temperature", type=float, default=1.0, help="1.0 is the OpenAI default")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--systems", default="abcd", help="which of a, b, c, d to run, in order")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="out/bench_policies.png", help="PNG path; JSON beside it")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Load the model once, run each system on the same trace, print the table, write the PNG and JSON."""
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    systems = [s for s in SYSTEMS if s.key in args.systems]
    if not systems or not set(args.systems) <= {s.key for s in SYSTEMS}:
        parser.error("--systems takes letters among a, b, c, d")
    if args.kv_tokens < args.max_model_len:
        parser.error("--kv-tokens must hold at least one max_model_len region")
    if args.system_prompt_len + args.prompt_len[1] >= args.max_model_len:
        parser.error("system prompt + longest prompt must leave room for output within --max-model-len")
    parts = build_parts(engine_config(systems[0], args))
    trace = make_trace(args, parts.vocab_size)
    # Warm-up (oneDNN primitives, the kernel library) so that the first system does not pay for it.
    warm = LLMEngine(engine_config(SYSTEMS[2], args), parts)
    warm.add_request("warm-up", trace[0].prompt, SamplingParams(max_tokens=4, ignore_eos=True, seed=0))
    while warm.has_unfinished_requests():
        warm.step()
    results = []
    with tqdm(total=len(systems) * len(trace), desc="bench_policies", unit="req", file=sys.stderr) as bar:
        for system in systems:
            bar.set_postfix_str(system.name)
            results.append(run_system(system, parts, trace, args, bar.update))
    print_table(results, trace, args)
    plot(results, args.out)
    payload = {"args": {k: v for k, v in vars(args).items()}, "results": [asdict(r) for r in results]}
    Path(args.out).with_suffix(".json").write_text(json.dumps(payload, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
