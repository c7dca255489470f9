"""`--trace`: a seeded trace in phases (chatty, long documents, both mixed) sent with its own arrival times,
scored by goodput per phase: requests meeting both SLOs (TTFT and TPOT, `--goodput`) per second, vLLM's
`bench serve --goodput` metric.

- chatty: short prompts (16-64 words) and answers (16-64 tokens) at a high rate;
- documents: prompts of 1.5k-3k words (one word is about one token) with short answers (8-32 tokens);
- mixed: both at once, each at half its phase rate.

Each phase lasts --phase-seconds; --trace-scale multiplies every rate. A phase's goodput is its requests (by
arrival) that met both objectives over the phase's length; the whole trace's is every request that met them over
the run (first arrival to last completion). While the trace runs the server's `/metrics` is read every half second
for the scheduler's chosen token budget and chunk (`scheduler_token_budget`, `scheduler_chunk_size`; a peer without
them has no curve), which the PNG draws beside the goodput per phase.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

PHASES = ("chatty", "documents", "mixed")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of the trace: when it is sent (seconds from the start), its phase, prompt and length."""

    at: float
    phase: str
    prompt: str
    max_tokens: int


def _chat(rng: random.Random, words: Sequence[str], at: float, phase: str) -> TraceRequest:
    """A short prompt with a short answer."""
    prompt = " ".join(rng.choice(words) for _ in range(rng.randint(16, 64)))
    return TraceRequest(at, phase, prompt, rng.randint(16, 64))


def _document(rng: random.Random, words: Sequence[str], at: float, phase: str) -> TraceRequest:
    """A long document with a short answer (a summary, a classification)."""
    prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1500, 3000)))
    return TraceRequest(at, phase, prompt, rng.randint(8, 32))


def make_trace(
    seed: int,
    words: Sequence[str],
    phase_seconds: float,
    chat_rate: float = 2.0,
    document_rate: float = 0.25,
) -> list[TraceRequest]:
    """The phased trace (Poisson arrivals per phase, rates in requests/s), the same for a seed."""
    rng = random.Random(seed)
    requests: list[TraceRequest] = []
    for index, phase in enumerate(PHASES):
        start = index * phase_seconds
        kinds = {"chatty": [(_chat, chat_rate)], "documents": [(_document, document_rate)]}.get(
            phase, [(_chat, chat_rate / 2), (_document, document_rate / 2)]
        )
        for make, rate in kinds:
            at = start + rng.expovariate(rate)
            while at < start + phase_seconds:
                requests.append(make(rng, words, at, phase))
                at += rng.expovariate(rate)
    return sorted(requests, key=lambda r: r.at)


def metric_value(exposition: str, name: str) -> float | None:
    """The first sample of `name` (any namespace prefix, any labels) in a Prometheus exposition."""
    for line in exposition.splitlines():
        sample = line.split("{", 1)[0].split(" ", 1)[0]
        if not line.startswith("#") and (sample == name or sample.endswith(":" + name)):
            return float(line.rsplit(" ", 1)[1])
    return None


async def sample_shape(
    client: httpx.AsyncClient, base_url: str, start: float, out: list[list[float]]
) -> None:
    """Append [t, budget, chunk] from /metrics every half second until cancelled (nothing for a peer)."""
    while True:
        try:
            text = (await client.get(f"{base_url}/metrics")).text
        except httpx.HTTPError:
            text = ""
        budget = metric_value(text, "scheduler_token_budget")
        if budget is None:
            return
        out.append([time.perf_counter() - start, budget, metric_value(text, "scheduler_chunk_size") or 0.0])
        await asyncio.sleep(0.5)


def phase_goodput(
    records: Sequence[Mapping[str, Any]], met: Sequence[bool], phase_seconds: float, duration: float
) -> dict[str, float]:
    """Goodput (req/s) per phase over its length, and over the whole run ("all")."""
    result = {
        phase: sum(ok for r, ok in zip(records, met, strict=True) if r["phase"] == phase) / phase_seconds
        for phase in PHASES
    }
    result["all"] = sum(met) / duration if duration else 0.0
    return result


async def run_trace(
    args: argparse.Namespace, target: Any, trace: Sequence[TraceRequest], send: Any, met_slos: Any
) -> dict[str, Any]:
    """Send the trace to `target` at its arrival times (`send` streams one request, as the serving benchmark's);
    the run's goodput per phase, latencies and the scheduler's shape over time."""
    from pagoda.server.bench.serving import BenchRequest, RequestResult, client_limits

    slos = dict(args.goodput)
    results = [RequestResult() for _ in trace]
    limits = client_limits()
    shape: list[list[float]] = []
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        start = time.perf_counter()
        sampler = asyncio.ensure_future(sample_shape(client, target.base_url, start, shape))
        tasks = []
        for index, (request, result) in enumerate(zip(trace, results, strict=True)):
            delay = request.at - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            bench = BenchRequest(request.prompt, request.max_tokens)
            tasks.append(asyncio.ensure_future(send(client, args, target, bench, result, index)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        sampler.cancel()
    met = [met_slos(r, slos) for r in results]
    records = [
        {**asdict(r), "phase": q.phase, "at": q.at, "met": ok}
        for q, r, ok in zip(trace, results, met, strict=True)
    ]
    done = [r for r in results if r.success]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {
        "target": target.label,
        "request_rate": "trace",
        "duration_s": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "goodput": phase_goodput(records, met, args.phase_seconds, duration),
        "attainment": sum(met) / len(met) if met else 0.0,
        "mean_ttft_ms": 1000 * sum(r.ttft for r in done) / len(done) if done else 0.0,
        "mean_tpot_ms": 1000 * sum(tpots) / len(tpots) if tpots else 0.0,
        "shape": shape,
        "requests": records,
    }


def trace_table(runs: Sequence[Mapping[str, Any]]) -> str:
    """Goodput per phase and over the whole trace per configuration, with the ratios the issue targets."""
    header = ["Configuration", *[f"{p} (req/s)" for p in PHASES], "whole trace", "met", "TTFT ms", "TPOT ms"]
    rows = [
        [
            str(run["target"]),
            *[f"{run['goodput'][p]:.3f}" for p in (*PHASES, "all")],
            f"{run['attainment']:.0%}",
            f"{run['mean_ttft_ms']:.0f}",
            f"{run['mean_tpot_ms']:.0f}",
        ]
        for run in runs
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [" | ".join(c.ljust(widths[i]) for i, c in enumerate(row)) for row in [header, *rows]]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def plot_trace(runs: Sequence[Mapping[str, Any]], phase_seconds: float, path: Path) -> bool:
    """Goodput per phase (bars per configuration) and the chosen token budget over time; False without
    matplotlib."""
    from pagoda.server.bench.plots import _pyplot

    plt = _pyplot()
    if plt is None:
        return False
    fig, (bars, budget) = plt.subplots(1, 2, figsize=(14, 4.8))
    width = 0.8 / max(1, len(runs))
    groups = (*PHASES, "all")
    for i, run in enumerate(runs):
        xs = [g + i * width for g in range(len(groups))]
        bars.bar(xs, [run["goodput"][g] for g in groups], width, label=str(run["target"]))
        if run["shape"]:
            budget.step(
                [p[0] for p in run["shape"]],
                [p[1] for p in run["shape"]],
                where="post",
                label=str(run["target"]),
            )
    bars.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], [*PHASES, "whole trace"])
    bars.set(title="Goodput (requests meeting TTFT and TPOT per second)", ylabel="req/s")
    bars.legend(fontsize=8)
    for boundary in range(1, len(PHASES)):
        budget.axvline(boundary * phase_seconds, color="grey", linestyle=":")
    budget.set(title="Token budget chosen per step", xlabel="seconds into the trace", ylabel="tokens")
    budget.set_yscale("log")
    budget.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
