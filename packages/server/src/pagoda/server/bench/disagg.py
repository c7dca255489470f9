"""The disaggregation benchmark (issue 40): short chat streams decode while long prompts keep arriving, on
colocated data-parallel cores and on prefill/decode cores, each core pinned to its own CPU in both.

    python tools/bench_serving.py --disagg                          # DP=2 against 1 prefill + 1 decode
    python tools/bench_serving.py --disagg --duration 120 --doc-rate 0.2 --png packages/server/docs/bench-disagg.png

Every configuration gets the same seeded workload: `--chat-streams` clients each send a chat turn (token-id prompt of
`--chat-len`, `--chat-output` tokens, streamed) and the next as soon as it ends, while documents of `--doc-len`
tokens (`--doc-output` tokens each) arrive as a Poisson process of `--doc-rate`. Measured over `--duration` seconds:
the chat streams' inter-token latency (p50, p99) and time to first token, the documents' time to first token, and
the throughput (prompt + generated tokens of the requests finished in the window per second). Before the load, a
few probe requests (greedy and seeded at temperature 1.0) are compared across the configurations: identical with
dense weights (`--flags "-q none --dtype float32 ..."`); a .gguf's kept blocks run one-row decodes through other
kernels than many-row prefills, and the decode core computes the first token inside its last partial block.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from pagoda.server.bench.serving import SERVED_NAME

Launch = Callable[[argparse.Namespace, str], AbstractContextManager[str]]
CONFIGS = {
    "colocated": "--data-parallel-size 2",
    "disaggregated": "--prefill-replicas 1 --decode-replicas 1",
}
PROBES = 4


@dataclass(slots=True)
class Stream:
    """One request's timings: when it was sent, when each chunk of text arrived, and its token counts."""

    kind: str  # "chat" or "doc"
    sent: float
    prompt_tokens: int
    chunks: list[float] = field(default_factory=list)
    output_tokens: int = 0
    ok: bool = False


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (nearest rank); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q / 100 * len(ordered)))) - 1]


async def send(client: httpx.AsyncClient, stream: Stream, prompt: list[int], body: dict[str, Any]) -> None:
    """Stream one completion, stamping each chunk's arrival."""
    payload = {"model": SERVED_NAME, "prompt": prompt, "stream": True, "ignore_eos": True, **body}
    payload["stream_options"] = {"include_usage": True}
    async with client.stream("POST", "/v1/completions", json=payload) as response:
        if response.status_code != 200:
            await response.aread()
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                stream.output_tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stream.chunks.append(time.monotonic())
    stream.ok = True


def random_prompt(rng: random.Random, length: int, high: int) -> list[int]:
    """Token ids below `high`, clear of the special tokens at the vocabulary's start."""
    low = min(1000, high // 2)
    return [rng.randrange(low, high) for _ in range(length)]


async def load(base_url: str, args: argparse.Namespace) -> tuple[list[Stream], float, float]:
    """Run the workload for `args.duration` seconds; every request, and the window's start and end."""
    rng = random.Random(args.seed)
    streams: list[Stream] = []
    limits = httpx.Limits(max_connections=args.chat_streams + 64)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        start = time.monotonic()
        end = start + args.duration

        async def chat(index: int) -> None:
            chat_rng = random.Random(args.seed * 1000 + index)
            while time.monotonic() < end:
                stream = Stream("chat", time.monotonic(), args.chat_len)
                streams.append(stream)
                body = {
                    "max_tokens": args.chat_output,
                    "temperature": args.temperature,
                    "seed": chat_rng.randrange(1 << 30),
                }
                await send(client, stream, random_prompt(chat_rng, args.chat_len, args.max_token_id), body)

        async def documents() -> None:
            tasks = []
            while True:
                await asyncio.sleep(rng.expovariate(args.doc_rate))
                if time.monotonic() >= end:
                    break
                stream = Stream("doc", time.monotonic(), args.doc_len)
                streams.append(stream)
                body = {
                    "max_tokens": args.doc_output,
                    "temperature": args.temperature,
                    "seed": rng.randrange(1 << 30),
                }
                tasks.append(
                    asyncio.create_task(
                        send(client, stream, random_prompt(rng, args.doc_len, args.max_token_id), body)
                    )
                )
            await asyncio.gather(*tasks)

        await asyncio.gather(*(chat(i) for i in range(args.chat_streams)), documents())
        return streams, start, end


def probe_texts(base_url: str, args: argparse.Namespace) -> list[str]:
    """The probes' texts: greedy and seeded at temperature 1.0, prompts of a few lengths."""
    rng = random.Random(args.seed + 7)
    texts = []
    with httpx.Client(base_url=base_url, timeout=600) as client:
        for i in range(PROBES):
            body = {
                "model": SERVED_NAME,
                "prompt": random_prompt(rng, args.probe_len * (1 + 2 * i), args.max_token_id),
                "max_tokens": 24,
                "temperature": 0.0 if i % 2 == 0 else 1.0,
                "seed": i,
                "ignore_eos": True,
            }
            response = client.post("/v1/completions", json=body)
            response.raise_for_status()
            texts.append(response.json()["choices"][0]["text"])
    return texts


def summarize(label: str, streams: list[Stream], start: float, end: float) -> dict[str, Any]:
    """The run's numbers: chat ITL and TTFT, document TTFT, throughput, and the ITL samples over time."""
    done = [s for s in streams if s.ok and s.chunks and s.chunks[-1] <= end + 60]
    chats = [s for s in done if s.kind == "chat"]
    docs = [s for s in done if s.kind == "doc"]
    gaps = [(b - start, (b - a) * 1000) for s in chats for a, b in itertools.pairwise(s.chunks)]
    itl = [g for _, g in gaps]
    # TPOT as vLLM's benchmark defines it: per request, (last token - first token) / (tokens - 1).
    tpot = [(s.chunks[-1] - s.chunks[0]) * 1000 / (len(s.chunks) - 1) for s in chats if len(s.chunks) > 1]
    window = max(max((s.chunks[-1] for s in done), default=end), end) - start
    processed = sum(s.prompt_tokens + s.output_tokens for s in done)
    return {
        "label": label,
        "chats": len(chats),
        "docs": len(docs),
        "failed": sum(not s.ok for s in streams),
        "itl_p50_ms": percentile(itl, 50),
        "itl_p99_ms": percentile(itl, 99),
        "itl_max_ms": max(itl, default=0.0),
        "tpot_p50_ms": percentile(tpot, 50),
        "tpot_p99_ms": percentile(tpot, 99),
        "chat_ttft_p50_ms": percentile([(s.chunks[0] - s.sent) * 1000 for s in chats], 50),
        "doc_ttft_p50_ms": percentile([(s.chunks[0] - s.sent) * 1000 for s in docs], 50),
        "throughput_tok_s": processed / window,
        "output_tok_s": sum(s.output_tokens for s in done) / window,
        "gaps": gaps,
    }


def ratio(run: dict[str, Any], base: dict[str, Any], key: str) -> str:
    """run[key] / base[key] as "0.42x"."""
    return f"{run[key] / max(base[key], 1e-9):.2f}x"


def table(runs: Sequence[dict[str, Any]], cpu: str, identical: int) -> str:
    """The runs side by side, then the targets' ratios (disaggregated / colocated)."""
    header = ["config", "chats", "docs", "failed", "TPOT p50 ms", "TPOT p99 ms", "ITL p50 ms", "ITL p99 ms",
              "ITL max ms", "chat TTFT p50 ms", "doc TTFT p50 ms", "tok/s (prompt+out)", "out tok/s"]  # fmt: skip
    rows = [
        [
            r["label"],
            str(r["chats"]),
            str(r["docs"]),
            str(r["failed"]),
            f"{r['tpot_p50_ms']:.1f}",
            f"{r['tpot_p99_ms']:.1f}",
            f"{r['itl_p50_ms']:.1f}",
            f"{r['itl_p99_ms']:.1f}",
            f"{r['itl_max_ms']:.0f}",
            f"{r['chat_ttft_p50_ms']:.0f}",
            f"{r['doc_ttft_p50_ms']:.0f}",
            f"{r['throughput_tok_s']:.0f}",
            f"{r['output_tok_s']:.1f}",
        ]
        for r in runs
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = [f"CPU: {cpu}", "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |"]
    lines.append("| " + " | ".join("-" * w for w in widths) + " |")
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in rows]
    by = {r["label"]: r for r in runs}
    if "colocated" in by and "disaggregated" in by:
        co, pd = by["colocated"], by["disaggregated"]
        lines.append(
            f"disaggregated / colocated: TPOT p99 {ratio(pd, co, 'tpot_p99_ms')} (target <= 0.5x), "
            f"ITL p99 {ratio(pd, co, 'itl_p99_ms')}, ITL max {ratio(pd, co, 'itl_max_ms')}, "
            f"throughput {ratio(pd, co, 'throughput_tok_s')} (target >= 0.8x), "
            f"identical probe texts: {identical}/{PROBES}"
        )
    return "\n".join(lines)


def plot(runs: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    """Chat inter-token latency over time, one series per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    for run in runs:
        gaps = [(t, g) for t, g in run["gaps"] if g > 0]  # two chunks read at once have no gap to draw
        ax.scatter([t for t, _ in gaps], [g for _, g in gaps], s=3, alpha=0.5, label=run["label"])
    logarithmic = any(g > 0 for run in runs for _, g in run["gaps"])
    ax.set(title=title, xlabel="seconds into the run", ylabel="chat inter-token latency (ms)")
    ax.set_yscale("log" if logarithmic else "linear")
    ax.grid(alpha=0.3)
    ax.legend(markerscale=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The benchmark's flags."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--disagg", action="store_true", help="this benchmark (tools/bench_serving.py's mode)"
    )
    parser.add_argument("--serve-model", default=None, help="the model (default: the bench's default model)")
    parser.add_argument("--flags", default="--replica-cpus 0;1", help="flags every configuration gets")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load per configuration")
    parser.add_argument("--chat-streams", type=int, default=4)
    parser.add_argument("--chat-len", type=int, default=128)
    parser.add_argument("--chat-output", type=int, default=64)
    parser.add_argument("--doc-rate", type=float, default=0.1, help="documents per second (Poisson)")
    parser.add_argument("--doc-len", type=int, default=2000)
    parser.add_argument("--doc-output", type=int, default=8)
    parser.add_argument(
        "--temperature", type=float, default=1.0, help="1.0 (the OpenAI default), 0 for greedy"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-token-id", type=int, default=20000, help="prompts draw token ids below this")
    parser.add_argument("--probe-len", type=int, default=40, help="the shortest probe prompt (tokens)")
    parser.add_argument("--png", type=Path, default=None, help="write the ITL-over-time plot here")
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args(list(argv))
    if args.serve_model is None:
        from pagoda.server.bench.serving import BENCH_MODEL

        args.serve_model = BENCH_MODEL
    return args


def runs(args: argparse.Namespace, launch: Launch) -> Iterator[tuple[dict[str, Any], list[str]]]:
    """Each configuration's summary and probe texts, one server at a time."""
    for label in args.configs:
        with launch(args, f"{CONFIGS[label]} {args.flags}") as base_url:
            texts = probe_texts(base_url, args)
            streams, start, end = asyncio.run(load(base_url, args))
        yield summarize(label, streams, start, end), texts


def main(argv: Sequence[str], launch: Launch, cpu: str) -> int:
    """Run every configuration, print the table, write the plot and JSON."""
    args = parse_args(argv)
    results = list(runs(args, launch))
    summaries = [s for s, _ in results]
    # Per probe: the same text on every configuration.
    identical = sum(len({texts[i] for _, texts in results}) == 1 for i in range(PROBES))
    print(table(summaries, cpu, identical))
    if args.png is not None:
        plot(summaries, args.png, f"Chat streams beside {args.doc_len}-token documents ({cpu})")
        print(f"wrote {args.png}")
    if args.output_json is not None:
        probes = {s["label"]: texts for s, texts in results}
        args.output_json.write_text(
            json.dumps({"cpu": cpu, "runs": summaries, "identical": identical, "probes": probes})
        )
    return 0
