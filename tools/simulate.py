"""Discrete-event serving simulation: static vs continuous batching, contiguous vs paged KV, prefix caching.

    .venv/bin/python tools/simulate.py                     # the four systems on one trace, table + out/simulate.png
    .venv/bin/python tools/simulate.py --sweep-block-size  # fragmentation and prefix hits vs block size
    .venv/bin/python tools/simulate.py --afd --afd-calibrate  # attention/FFN disaggregation vs colocated decode

The real `Scheduler` and `BlockManager` decide every step; only the model is simulated, by a step-cost model
of roughly OPT-13B on one A100-40GB (the vLLM paper's setting): a step takes a fixed overhead (reading the
weights, ~26 GB at ~1.5 TB/s) plus a per-token compute cost (2 * 13e9 FLOP at ~60% of 312 TFLOP/s) plus a
per-KV-token read cost (~0.8 MB of K/V per token at ~1.5 TB/s). Every system gets the same KV memory
(`--kv-tokens` token slots) and the same trace.

Trace: Poisson arrivals; ShareGPT-like lengths from lognormal fits whose means match what the vLLM paper
(§6.1) reports for ShareGPT, about 161 prompt and 338 output tokens (prompt: mu=4.58, sigma=1.0; output:
mu=5.50, sigma=0.8; natural log; clipped to [4, max_model_len/2] and to max_model_len overall). Each prompt
starts with one of `--num-system-prompts` shared system prompts of `--system-prompt-len` tokens, as chat
front-ends send them; the rest of the tokens are random. Output lengths are fixed by the trace (no stop token).

Systems (same trace, same KV memory):
  (a) static batching, contiguous per-request preallocation of max_model_len (FasterTransformer-style)
  (b) continuous batching, contiguous preallocation (Orca-style with max-length reservation)
  (c) continuous batching, paged KV (vLLM)
  (d) (c) plus prefix caching

`--afd` instead prints a cost model (pagoda.server.bench.afd_model) of attention/FFN disaggregation against
colocated decode: per-token step time, tokens/s per device and speed-up over batch x link bandwidth x context,
and the break-even batch, for an H100-like device and (`--afd-calibrate`, pagoda.server.bench.afd_calibrate)
this machine's CPU measured with torch, its gloo loopback as one more link. Its AFD is the built one (attention
split over the heads among the attention workers, o_proj all-reduced); `--afd-attention sequences` models
data-parallel attention instead (each attention worker all the attention weights and its share of the sequences).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagoda.blockalloc import BlockManager
from pagoda.scheduler import (
    ContiguousKVManager,
    FCFSPolicy,
    KVBlockManager,
    Request,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    SchedulingPolicy,
    StaticBatchPolicy,
)
from pagoda.scheduler.testing import SimSamplingParams, kv_occupancy
from tqdm import tqdm

if TYPE_CHECKING:  # the AFD model is imported when --afd asks for it (torch only with --afd-calibrate)
    from pagoda.server.bench.afd_model import AfdShape, Device, Link, ModelConfig

PROMPT_LOGNORMAL = (4.58, 1.0)  # mean exp(4.58 + 0.5) ~ 161 tokens
OUTPUT_LOGNORMAL = (5.50, 0.8)  # mean exp(5.50 + 0.32) ~ 338 tokens
SYSTEMS = {
    "a": "static + contiguous",
    "b": "continuous + contiguous",
    "c": "continuous + paged",
    "d": "paged + prefix cache",
}
SWEEP_BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
# --afd: the stage that sets an AFD step's pace, as the table abbreviates it.
SLOWEST = {"attention": "attn", "ffn": "ffn", "link": "link", "round trip": "trip"}


@dataclass(frozen=True)
class CostModel:
    """Seconds per step = overhead + per_token * batched tokens + per_kv_token * KV tokens read."""

    overhead_s: float = 0.017
    per_token_s: float = 0.14e-3
    per_kv_token_s: float = 0.55e-6

    def step_time(self, out: SchedulerOutput) -> float:
        """Duration of one step: each chunk reads the KV of its whole context."""
        kv_tokens = sum(chunk.seq_len for chunk in out.scheduled)
        return self.overhead_s + self.per_token_s * out.num_batched_tokens + self.per_kv_token_s * kv_tokens


@dataclass(frozen=True)
class TraceRequest:
    """One request of the trace."""

    arrival: float
    prompt: tuple[int, ...]
    output_len: int


def make_trace(
    num_requests: int,
    rate: float,
    max_model_len: int,
    system_prompt_len: int,
    num_system_prompts: int,
    seed: int,
) -> list[TraceRequest]:
    """Poisson arrivals at `rate`/s with ShareGPT-like lognormal lengths behind a shared system prompt."""
    rng = random.Random(seed)
    systems = [
        tuple(rng.randrange(1, 32_000) for _ in range(system_prompt_len)) for _ in range(num_system_prompts)
    ]
    trace, now = [], 0.0
    for _ in range(num_requests):
        now += rng.expovariate(rate)
        user_len = min(max(4, round(rng.lognormvariate(*PROMPT_LOGNORMAL))), max_model_len // 2)
        prefix = rng.choice(systems) if systems else ()
        user_len = min(user_len, max(4, max_model_len // 2 - len(prefix)))
        prompt = prefix + tuple(rng.randrange(1, 32_000) for _ in range(user_len))
        output_len = min(max(4, round(rng.lognormvariate(*OUTPUT_LOGNORMAL))), max_model_len - len(prompt))
        trace.append(TraceRequest(now, prompt, output_len))
    return trace


@dataclass
class Result:
    """What one simulated system achieved."""

    name: str
    makespan_s: float = 0.0
    latencies: list[float] = field(default_factory=list)
    output_tokens: int = 0
    util_weighted: float = 0.0  # sum of (real / reserved slots) * step time
    frag_weighted: float = 0.0  # sum of (reserved unused slots / reserved slots) * step time
    table_weighted: float = 0.0  # sum of (mean block-table entries per running sequence) * step time
    sampled_time: float = 0.0
    timeline: list[tuple[float, float]] = field(default_factory=list)  # (time, utilization)
    hit_rate: float = 0.0
    preemptions: int = 0

    @property
    def request_throughput(self) -> float:
        """Finished requests per second."""
        return len(self.latencies) / self.makespan_s

    @property
    def token_throughput(self) -> float:
        """Generated tokens per second."""
        return self.output_tokens / self.makespan_s

    @property
    def utilization(self) -> float:
        """Time-averaged share of reserved KV slots that hold real tokens."""
        return self.util_weighted / self.sampled_time if self.sampled_time else 0.0

    @property
    def fragmentation(self) -> float:
        """Time-averaged share of reserved KV slots that are empty."""
        return self.frag_weighted / self.sampled_time if self.sampled_time else 0.0

    @property
    def table_entries(self) -> float:
        """Time-averaged block-table entries per running sequence."""
        return self.table_weighted / self.sampled_time if self.sampled_time else 0.0

    def percentile(self, q: float) -> float:
        """Latency percentile (nearest rank)."""
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def build(system: str, args: argparse.Namespace, block_size: int, clock: Callable[[], float]) -> Scheduler:
    """Scheduler and KV manager of one system, with `args.kv_tokens` slots of KV memory; `clock` is sim time."""
    num_blocks = args.kv_tokens // block_size
    prefix = system == "d"
    paged = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    kv: KVBlockManager = paged if system in "cd" else ContiguousKVManager(paged, args.max_model_len)
    policy: SchedulingPolicy = FCFSPolicy()
    if system == "a":
        batch = max(1, min(args.max_num_seqs, num_blocks // -(-args.max_model_len // block_size)))
        policy = StaticBatchPolicy(batch, args.static_timeout, clock=clock)
    config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=prefix,
    )
    return Scheduler(config, kv, policy)


def measure_memory(sched: Scheduler) -> tuple[float, float, float]:
    """(real / reserved, empty / reserved, table entries per sequence) of the KV slots right now."""
    occupancy = kv_occupancy(sched)
    if not occupancy.reserved_tokens or not occupancy.num_running:
        return 0.0, 0.0, 0.0
    util = occupancy.utilization
    return util, 1 - util, occupancy.table_entries / occupancy.num_running


def simulate(
    system: str,
    trace: Sequence[TraceRequest],
    args: argparse.Namespace,
    block_size: int,
    progress: Callable[[int], object],
) -> Result:
    """Run `trace` through one system; time advances by the cost model's step time."""
    now, next_index, step = 0.0, 0, 0
    sched = build(system, args, block_size, clock=lambda: now)  # the static batch timeout runs on sim time
    cost = CostModel()
    result = Result(SYSTEMS[system])
    arrivals = {f"q{i}": t.arrival for i, t in enumerate(trace)}
    while next_index < len(trace) or sched.has_unfinished_requests():
        while next_index < len(trace) and trace[next_index].arrival <= now:
            t = trace[next_index]
            params = SimSamplingParams(max_tokens=t.output_len)
            sched.add_request(Request(f"q{next_index}", t.prompt, params, arrival_time=t.arrival))
            next_index += 1
        out = sched.schedule()
        if out.is_empty:  # idle, or a static batch still forming: jump to the next event
            upcoming = trace[next_index].arrival if next_index < len(trace) else math.inf
            now = min(upcoming, now + args.static_timeout / 4)
            continue
        dt = cost.step_time(out)
        if step % args.measure_every == 0:
            util, frag, entries = measure_memory(sched)
            weight = dt * args.measure_every
            result.util_weighted += util * weight
            result.frag_weighted += frag * weight
            result.table_weighted += entries * weight
            result.sampled_time += weight
            result.timeline.append((now, util))
        step += 1
        now += dt
        sampled = {sid: [7] for chunk in out.scheduled for sid in chunk.sample_ids}
        for request in sched.update_from_output(out, sampled):
            result.latencies.append(now - arrivals[request.request_id])
            result.output_tokens += request.num_output_tokens
            progress(1)
    stats = sched.stats()
    result.makespan_s = now
    result.hit_rate = stats.prefix_cache_hit_rate
    result.preemptions = stats.num_preemptions
    return result


def compare(args: argparse.Namespace) -> list[Result]:
    """The four systems on one trace; prints the table and writes the plot."""
    trace = make_trace(
        args.num_requests,
        args.rate,
        args.max_model_len,
        args.system_prompt_len,
        args.num_system_prompts,
        args.seed,
    )
    results = []
    with tqdm(total=len(SYSTEMS) * len(trace), desc="simulate", unit="req", file=sys.stderr) as bar:
        for system in SYSTEMS:
            bar.set_postfix_str(SYSTEMS[system])
            results.append(simulate(system, trace, args, args.block_size, bar.update))
    mean_prompt = statistics.fmean(len(t.prompt) for t in trace)
    mean_output = statistics.fmean(t.output_len for t in trace)
    print(
        f"\n{len(trace)} requests at {args.rate}/s (Poisson), mean prompt {mean_prompt:.0f} / output "
        f"{mean_output:.0f} tokens, KV memory {args.kv_tokens} token slots, block size {args.block_size}, "
        f"max_model_len {args.max_model_len}"
    )
    header = f"{'system':<26}{'req/s':>8}{'tok/s':>9}{'mean lat s':>12}{'p99 lat s':>11}{'KV util':>9}"
    print(header + f"{'prefix hit':>12}{'preempt':>9}  speed-up vs (a)")
    base = results[0].request_throughput
    for r in results:
        print(
            f"{r.name:<26}{r.request_throughput:>8.2f}{r.token_throughput:>9.0f}"
            f"{statistics.fmean(r.latencies):>12.1f}{r.percentile(0.99):>11.1f}{r.utilization:>9.1%}"
            f"{r.hit_rate:>12.1%}{r.preemptions:>9}  {r.request_throughput / base:.2f}x"
        )
    plot_compare(results, args.out)
    return results


def sweep(args: argparse.Namespace) -> list[tuple[int, Result]]:
    """System (d) at each block size: internal fragmentation, prefix-cache hit rate, block-table size."""
    trace = make_trace(
        args.num_requests,
        args.rate,
        args.max_model_len,
        args.system_prompt_len,
        args.num_system_prompts,
        args.seed,
    )
    sizes = [bs for bs in SWEEP_BLOCK_SIZES if bs <= args.max_model_len]
    rows = []
    with tqdm(total=len(sizes) * len(trace), desc="sweep", unit="req", file=sys.stderr) as bar:
        for bs in sizes:
            bar.set_postfix_str(f"block size {bs}")
            rows.append((bs, simulate("d", trace, args, bs, bar.update)))
    print(f"\npaged + prefix cache, {len(trace)} requests, KV memory {args.kv_tokens} token slots")
    print(f"{'block size':>10}{'fragmentation':>15}{'prefix hit':>12}{'table entries/seq':>19}{'req/s':>8}")
    for bs, r in rows:
        print(
            f"{bs:>10}{r.fragmentation:>15.1%}{r.hit_rate:>12.1%}{r.table_entries:>19.1f}"
            f"{r.request_throughput:>8.2f}"
        )
    plot_sweep(rows, args.out)
    return rows


def plot_compare(results: Sequence[Result], out: str) -> None:
    """Throughput, latency and KV utilization bars, and utilization over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name for r in results]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    axes[0][0].bar(names, [r.request_throughput for r in results], color="tab:blue")
    axes[0][0].set_ylabel("requests / s")
    axes[0][1].bar(names, [statistics.fmean(r.latencies) for r in results], label="mean", color="tab:orange")
    axes[0][1].plot(names, [r.percentile(0.99) for r in results], "k^", label="p99")
    axes[0][1].set_ylabel("latency (s)")
    axes[0][1].legend()
    axes[1][0].bar(names, [r.utilization for r in results], color="tab:green")
    axes[1][0].set_ylabel("KV slots holding real tokens / reserved")
    axes[1][0].set_ylim(0, 1.05)
    for r in results:
        axes[1][1].plot([t for t, _ in r.timeline], [u for _, u in r.timeline], label=r.name, linewidth=0.8)
    axes[1][1].set_xlabel("simulated time (s)")
    axes[1][1].set_ylabel("KV utilization")
    axes[1][1].legend(fontsize=8)
    for ax in (axes[0][0], axes[0][1], axes[1][0]):
        ax.tick_params(axis="x", labelsize=8, rotation=15)
    fig.suptitle("Same trace, same KV memory: static vs continuous batching, contiguous vs paged KV")
    fig.tight_layout()
    save(fig, out)


def plot_sweep(rows: Sequence[tuple[int, Result]], out: str) -> None:
    """Fragmentation, hit rate and table size against block size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [bs for bs, _ in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    series = [
        ([r.fragmentation for _, r in rows], "internal fragmentation (empty / reserved)"),
        ([r.hit_rate for _, r in rows], "prefix-cache hit rate (tokens)"),
        ([r.table_entries for _, r in rows], "block-table entries per sequence"),
    ]
    for ax, (values, label) in zip(axes, series, strict=True):
        ax.plot(sizes, values, "o-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (tokens)")
        ax.set_title(label, fontsize=10)
    axes[2].set_yscale("log")
    fig.tight_layout()
    save(fig, out)


def save(fig: object, out: str) -> None:
    """Write the figure, creating its folder."""
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    plt.savefig(out, dpi=110)
    plt.close("all")
    print(f"plot written to {out}")


def _num(value: float) -> str:
    """Three significant figures, k/M for thousands and millions, '-' for infinity."""
    if not math.isfinite(value):
        return "-"
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def afd_table(
    cfg: ModelConfig,
    dev: Device,
    links: Sequence[Link],
    contexts: Sequence[int],
    batches: Sequence[int],
    shape: AfdShape,
) -> None:
    """For each context: one row per batch, colocated then AFD over each link."""
    from pagoda.server.bench import afd_model as afd

    print(
        f"\ndevice {dev.name}: weights {dev.weight_bw / 1e9:.4g} GB/s, KV {dev.kv_bw / 1e9:.4g} GB/s, "
        f"{dev.flops / 1e12:.4g} TFLOP/s, {dev.overhead_s * 1e6:.3g} us per layer side, "
        f"{dev.capacity_bytes / 2**30:.1f} GiB usable"
    )
    cell = 34
    for context in contexts:
        print(
            f"context {context} (KV {afd.kv_bytes_per_seq(cfg, context) / 2**20:.4g} MiB per sequence): colocated "
            "= step ms, replicas, tok/s per device; AFD = step ms, A+F, tok/s per device, speed-up, slowest stage"
        )
        print(f"{'batch':>6} | {'colocated':<22} | " + " | ".join(f"{link.name:<{cell}}" for link in links))
        for batch in batches:
            col = afd.colocated(cfg, dev, batch, context)
            replicas = str(col.devices) if col.devices else "-"
            rate = _num(col.tokens_per_device_s(batch)) if col.devices else "-"
            row = f"{batch:>6} | {_num(col.step_s * 1e3):>7} {replicas:>4} {rate:>9} |"
            for link in links:
                plan = afd.disaggregated(cfg, dev, link, batch, context, shape)
                x = afd.speedup(cfg, dev, link, batch, context, shape)
                if not plan.devices:
                    row += f" {'-':>7} {'-':>6} {'-':>7} {'-':>6} {'mem':<4} |"
                    continue
                ratio = "  only" if math.isinf(x) else f"{x:>5.2f}x"
                row += (
                    f" {_num(plan.step_s * 1e3):>7} {plan.attn_workers:>3}+{plan.ffn_workers:<2}"
                    f" {_num(plan.tokens_per_device_s(batch)):>7} {ratio} {SLOWEST[plan.bottleneck]:<4} |"
                )
            print(row)


def afd_break_even(
    cfg: ModelConfig,
    devices: Sequence[Device],
    links: Sequence[Link],
    contexts: Sequence[int],
    largest: int,
    shape: AfdShape,
) -> None:
    """Per device and context, each link's break-even batch and the best speed-up up to `largest`."""
    from pagoda.server.bench import afd_model as afd

    grid = afd.batch_grid(largest)
    print(
        f"\nbreak-even batch: the smallest of 1..{largest} (4 sizes per octave) at which AFD's tokens/s per device "
        "reach colocated decode's ('-': none), and in brackets the best speed-up over those batches"
    )
    width = max(len(d.name) for d in devices)
    print(f"{'device':<{width}} {'context':>7} | " + " | ".join(f"{link.name:<16}" for link in links))
    for dev in devices:
        for context in contexts:
            cells = []
            for link in links:
                even = afd.break_even_batch(cfg, dev, link, context, grid, shape)
                best = max(afd.speedup(cfg, dev, link, b, context, shape) for b in grid)
                ratio = "only" if math.isinf(best) else f"{best:.2f}x"
                cells.append(f"{even if even is not None else '-':>5} ({ratio})".ljust(16))
            print(f"{dev.name:<{width}} {context:>7} | " + " | ".join(cells))


def afd_report(args: argparse.Namespace) -> int:
    """--afd: the model's tables for the GPU-like device and, with --afd-calibrate, this machine."""
    from pagoda.server.bench import afd_model as afd

    cfg = afd.MODELS[args.afd_model]
    gpu = afd.Device(
        args.afd_device_name,
        args.afd_mem_bw_gbps * 1e9,
        args.afd_mem_bw_gbps * 1e9,
        args.afd_tflops * 1e12,
        args.afd_overhead_us * 1e-6,
        args.afd_mem_util * args.afd_mem_gib * 2**30,
    )
    latency = args.afd_link_latency_us * 1e-6
    links = [afd.Link(f"{g:g} GB/s", g * 1e9, latency) for g in args.afd_link_gbps]
    devices = [gpu]
    window = (
        f", sliding window {cfg.sliding_window} except every {cfg.global_every}th layer"
        if cfg.sliding_window
        else ""
    )
    print(
        f"AFD vs colocated decode, cost model (run on {afd.cpu_name()}): {cfg.name}, hidden {cfg.hidden}, "
        f"intermediate {cfg.intermediate}, {cfg.layers} layers, {cfg.heads} heads / {cfg.kv_heads} KV heads x "
        f"{cfg.head_dim}, {cfg.dtype_bytes}-byte weights and KV{window}; decoder layers only"
    )
    if args.afd_calibrate:
        from pagoda.server.bench import afd_calibrate

        cal = afd_calibrate.calibrate(cfg, args.afd_threads, args.afd_mem_util)
        print("\n".join(afd_calibrate.describe(cfg, cal)))
        links.insert(0, cal.link)
        devices.append(cal.device)
    print(
        "links: "
        + "; ".join(
            f"{link.name}: {link.bandwidth / 1e9:.3g} GB/s + {link.latency_s * 1e6:.3g} us" for link in links
        )
    )
    shape = afd.AfdShape(
        args.afd_attn_workers,
        args.afd_ffn_workers,
        args.afd_micro_batches,
        args.afd_max_ffn_workers,
        args.afd_attention,
    )
    a = (
        "chosen per row for the most tokens/s per device"
        if shape.attn_workers is None
        else shape.attn_workers
    )
    f = f"chosen, at most {shape.max_ffn_workers}" if shape.ffn_workers is None else shape.ffn_workers
    split = (
        "attention split over the heads (as built: each worker 1/A of the heads, their weights and KV, o_proj "
        "all-reduced among them)"
        if shape.attention == "heads"
        else "data-parallel attention (not built: each worker all the attention weights, 1/A of the sequences)"
    )
    print(
        f"AFD: {shape.micro_batches} micro-batches, A attention workers {a}, F FFN workers {f}, {split}; "
        "colocated: as few data-parallel replicas as hold the KV"
    )
    print(
        "slowest stage: attn (attention worker), ffn (FFN worker), link (one transfer), trip (one micro-batch's "
        "attention + FFN + both transfers: too few micro-batches to hide them); mem: the KV does not fit these "
        "workers; 'only': colocated decode does not fit one device"
    )
    for dev in devices:
        afd_table(cfg, dev, links, args.afd_contexts, args.afd_batches, shape)
    afd_break_even(cfg, devices, links, args.afd_contexts, max(args.afd_batches), shape)
    if args.afd_calibrate:
        print(
            f"\nthis machine as it is: its {os.cpu_count()} cores as 1 attention + 1 FFN worker over gloo loopback, "
            "against colocated decode on one core"
        )
        pair = afd.AfdShape(1, 1, args.afd_micro_batches, attention=args.afd_attention)
        afd_table(cfg, devices[-1], links[:1], args.afd_contexts, args.afd_batches, pair)
    return 0


def add_afd_arguments(parser: argparse.ArgumentParser) -> None:
    """The --afd flags (the model's constants default to an H100-like GPU and an 8B Llama-like model)."""
    group = parser.add_argument_group("attention/FFN disaggregation cost model (--afd)")
    group.add_argument("--afd", action="store_true", help="print the AFD vs colocated decode tables instead")
    group.add_argument("--afd-model", default="llama-8b", choices=("llama-8b", "smollm2-135m", "gemma3-270m"))
    group.add_argument("--afd-calibrate", action="store_true", help="measure this machine: a device and gloo")
    group.add_argument("--afd-threads", type=int, default=1, help="torch threads while calibrating")
    group.add_argument("--afd-batches", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    group.add_argument("--afd-contexts", type=int, nargs="+", default=[512, 4096, 32768])
    group.add_argument("--afd-link-gbps", type=float, nargs="+", default=[25.0, 100.0, 400.0])
    group.add_argument("--afd-link-latency-us", type=float, default=5.0)
    group.add_argument("--afd-device-name", default="H100-like")
    group.add_argument("--afd-mem-bw-gbps", type=float, default=3000.0, help="weights and KV, sustained")
    group.add_argument("--afd-tflops", type=float, default=700.0, help="sustained dense FLOP/s, in TFLOP/s")
    group.add_argument("--afd-overhead-us", type=float, default=4.0, help="fixed cost per layer side")
    group.add_argument("--afd-mem-gib", type=float, default=80.0)
    group.add_argument("--afd-mem-util", type=float, default=0.9, help="share of memory for weights and KV")
    group.add_argument("--afd-attn-workers", type=int, help="A (default: the best per row)")
    group.add_argument("--afd-ffn-workers", type=int, help="F (default: the best per row)")
    group.add_argument("--afd-max-ffn-workers", type=int, default=8)
    group.add_argument("--afd-micro-batches", type=int, default=2, help="2: ping-pong")
    group.add_argument(
        "--afd-attention",
        choices=("heads", "sequences"),
        default="heads",
        help="how attention splits over the A workers: heads (as built) or sequences (data-parallel, not built)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments and run the comparison or the block-size sweep."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sweep-block-size", action="store_true", help="sweep block sizes 1..256 instead")
    parser.add_argument("--num-requests", type=int, default=600)
    parser.add_argument("--rate", type=float, default=8.0, help="Poisson arrival rate, requests per second")
    parser.add_argument(
        "--kv-tokens", type=int, default=16_384, help="KV memory of every system, in token slots"
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--system-prompt-len", type=int, default=128)
    parser.add_argument("--num-system-prompts", type=int, default=4)
    parser.add_argument("--static-timeout", type=float, default=1.0, help="static batching: longest wait (s)")
    parser.add_argument("--measure-every", type=int, default=8, help="steps between KV memory measurements")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out",
        help="PNG plot path (default out/simulate.png, or out/simulate_sweep.png with --sweep-block-size)",
    )
    add_afd_arguments(parser)
    args = parser.parse_args(argv)
    if args.afd:
        return afd_report(args)
    if args.kv_tokens < args.max_model_len:
        parser.error("--kv-tokens must hold at least one max_model_len sequence")
    if args.out is None:
        args.out = "out/simulate_sweep.png" if args.sweep_block_size else "out/simulate.png"
    if args.sweep_block_size:
        sweep(args)
    else:
        compare(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
