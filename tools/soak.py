"""Soak benchmark: does the server's memory stay flat over many requests?

Starts `pagoda serve` (on a tiny random Llama by default, `--model PATH` for a real one, `--default-model` for
the server's default), sends `--requests` requests of mixed shapes (prompt lengths, max_tokens, n, completions
or chat, streamed or not, some cancelled mid-stream) with `--concurrency` in flight, and prints the server's
RSS every `--every` requests, then the growth per 1,000 requests after `--warmup` requests.

`--distinct-schemas` makes every request a structured-outputs request with a JSON schema of its own (each one
compiles anew), and adds the compiled-grammar cache's size (`grammar_cache_bytes` of /metrics) to each row: the
RSS must level off once the cache reaches `--grammar-cache-bytes`.

    python tools/soak.py --requests 5000
    python tools/soak.py --default-model --requests 3000 --concurrency 8
    python tools/soak.py --distinct-schemas --requests 3000 --serve-arg=--grammar-cache-bytes=67108864

`--slow-reader` instead opens `--concurrency` connections that each ask for a streamed `n = 4` completion of
`--max-tokens` tokens with 20 logprobs per token and never read the answer, and prints the server's RSS every
`--sample-seconds` for `--duration` seconds (the server keeps one snapshot per stream and aborts a reader stalled
past its --stream-stall-timeout, so the RSS should stay flat):

    python tools/soak.py --slow-reader --concurrency 4 --max-tokens 3000 --duration 60

`--surfaces` runs issue #43's surfaces at once for `--duration` seconds (tools/soak_surfaces.py: two tenant keys'
stored /v1/responses, the admin key's runtime LoRA load/unload under rotating names with the tenants' requests on
them, dashboard viewers, keyed KV event subscribers), prints the RSS every `--sample-seconds`, then its growth
from the first sample after `--warmup-seconds` to the last, the operations per surface and the errors (exit 1 on
any error, or a surface that did nothing):

    python tools/soak.py --surfaces --duration 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import soak_surfaces
from pagoda.server.testing import LiveServer, free_port, make_tiny_model
from pagoda.server.testing.tiny_lora import make_tiny_lora
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
MODEL_NAME = "soak"
_WORDS = ("the", "of", "and", "to", "in", "is", "was", "for", "on", "are", "with", "as", "at", "be", "this")


@dataclass(frozen=True, slots=True)
class Sample:
    """The server's RSS after a number of finished requests."""

    requests: int
    rss_bytes: int
    cache_bytes: int | None = None  # the compiled-grammar cache (--distinct-schemas only)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The soak options."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", default=None, help="model folder or .gguf (default: a tiny random Llama)")
    which.add_argument("--default-model", action="store_true", help="the server's default model")
    parser.add_argument("--requests", type=int, default=5000, help="requests to send")
    parser.add_argument("--every", type=int, default=500, help="sample the RSS every this many requests")
    parser.add_argument("--warmup", type=int, default=1000, help="requests before the growth is measured")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--max-prompt-words", type=int, default=200, help="longest prompt, in words")
    parser.add_argument("--max-tokens", type=int, default=32, help="largest max_tokens")
    parser.add_argument(
        "--cancel-fraction", type=float, default=0.1, help="streams cancelled after one chunk"
    )
    parser.add_argument(
        "--distinct-schemas",
        action="store_true",
        help="every request constrained by a JSON schema of its own; rows add the grammar cache's size",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `pagoda serve` argument")
    parser.add_argument(
        "--slow-reader", action="store_true", help="never-reading streamed clients; RSS over time"
    )
    parser.add_argument(
        "--surfaces", action="store_true", help="issue #43's surfaces at once for --duration seconds"
    )
    parser.add_argument(
        "--duration", type=float, default=60.0, help="--slow-reader, --surfaces: seconds to run"
    )
    parser.add_argument(
        "--sample-seconds", type=float, default=1.0, help="--slow-reader, --surfaces: RSS sampling period"
    )
    parser.add_argument(
        "--warmup-seconds", type=float, default=10.0, help="--surfaces: seconds before the growth is measured"
    )
    args = parser.parse_args(argv)
    if args.requests < 1 or args.every < 1 or args.concurrency < 1:
        parser.error("--requests, --every and --concurrency must be >= 1")
    if args.surfaces and (args.slow_reader or args.default_model):
        parser.error("--surfaces runs on a model folder: not with --slow-reader or --default-model")
    return args


@contextmanager
def model_source(args: argparse.Namespace) -> Iterator[list[str]]:
    """The model arguments of `pagoda serve`: as given, none for the default, or a tiny model built here."""
    if args.default_model:
        yield []
        return
    if args.model is not None:
        yield [args.model]
        return
    with tempfile.TemporaryDirectory(prefix="soak-tiny-") as tmp:
        yield [str(make_tiny_model("llama", Path(tmp) / "llama", max_position_embeddings=1024))]


def running_server(
    model_args: list[str], args: argparse.Namespace, flags: list[str] | None = None, capture_log: bool = False
) -> LiveServer:
    """A `pagoda serve` subprocess on --port with `flags` and --serve-arg, healthy; its output goes to this
    terminal unless `capture_log` (then `log_tail()` reads it). Stop it with SIGTERM."""
    return LiveServer(
        model_args[0] if model_args else None,
        [*(flags or []), *args.serve_arg],
        served_model_name=MODEL_NAME,
        port=args.port,
        ready_timeout=600,
        capture_log=capture_log,
        cwd=ROOT,
    )


def request_body(rng: random.Random, args: argparse.Namespace) -> tuple[str, dict[str, Any], bool]:
    """(route, JSON body, cancel after the first chunk) of one request of random shape."""
    text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, args.max_prompt_words)))
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "max_tokens": rng.randint(1, args.max_tokens),
        "n": rng.choice([1, 1, 1, 2, 3]),
        "stream": rng.random() < 0.5,
        "temperature": rng.choice([0.0, 0.8]),
        "ignore_eos": True,
    }
    if rng.random() < 0.5:
        route, body["prompt"] = "/v1/completions", text
    else:
        route, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
    cancel = body["stream"] and rng.random() < args.cancel_fraction
    if args.distinct_schemas:
        body["structured_outputs"] = {"json": distinct_schema(rng)}
    return route, body, cancel


def distinct_schema(rng: random.Random) -> dict[str, Any]:
    """A small JSON schema no other request sends (its property names and bounds are drawn at random)."""
    key = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(12))
    return {
        "type": "object",
        "properties": {key: {"type": "string", "maxLength": rng.randint(1, 64)}, "n": {"type": "integer"}},
        "required": [key],
    }


async def grammar_cache_bytes(client: httpx.AsyncClient) -> int | None:
    """The server's `<prefix>:grammar_cache_bytes` gauge, from /metrics (None if it has none)."""
    response = await client.get("/metrics")
    for line in response.text.splitlines():
        name, _, value = line.partition(" ")
        if name.split("{")[0].endswith(":grammar_cache_bytes"):
            return int(float(value))
    return None


async def send(client: httpx.AsyncClient, route: str, body: dict[str, Any], cancel: bool) -> None:
    """Send one request; a cancelled stream closes its connection after the first chunk."""
    if not body["stream"]:
        response = await client.post(route, json=body)
        response.raise_for_status()
        return
    async with client.stream("POST", route, json=body) as response:
        response.raise_for_status()
        async for _ in response.aiter_bytes():
            if cancel:
                return  # leaving the block closes the connection mid-stream: the server aborts the request


async def soak(args: argparse.Namespace, server: psutil.Process) -> list[Sample]:
    """Send the requests; the server's RSS at the start and after every `--every` of them."""
    rng = random.Random(args.seed)
    shapes = [request_body(rng, args) for _ in range(args.requests)]
    samples = [Sample(0, server.memory_info().rss)]
    print(HEADER, row(samples[0], None), sep="\n", flush=True)
    limits = httpx.Limits(max_connections=args.concurrency)
    base_url = f"http://127.0.0.1:{args.port}"
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
        queue: asyncio.Queue[tuple[str, dict[str, Any], bool]] = asyncio.Queue()
        for shape in shapes:
            queue.put_nowait(shape)
        done = 0
        progress = tqdm(total=args.requests, unit="req")

        async def worker() -> None:
            nonlocal done
            while not queue.empty():
                await send(client, *queue.get_nowait())
                done += 1
                progress.update()
                if done % args.every == 0:
                    count = done  # before the scrape's await, while which the other workers go on counting
                    cache = await grammar_cache_bytes(client) if args.distinct_schemas else None
                    samples.append(Sample(count, server.memory_info().rss, cache))
                    progress.write(row(samples[-1], samples[-2]))

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        progress.close()
    return samples


def never_reading_client(port: int, max_tokens: int) -> socket.socket:
    """A connection that asks for a long streamed n = 4 completion with logprobs and never reads the answer."""
    body = {
        "model": MODEL_NAME,
        "prompt": "the slow reader",
        "n": 4,
        "logprobs": 20,
        "stream": True,
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    payload = json.dumps(body).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server backs up early
    sock.connect(("127.0.0.1", port))
    sock.sendall(head + payload)
    return sock


TIME_HEADER = f"{'seconds':>9} {'RSS MB':>9} {'delta MB':>9}"


def sample_now(server: psutil.Process, start: float, samples: list[tuple[float, int]]) -> None:
    """Append (seconds since `start`, RSS) to `samples` and print its row (and the change since the last)."""
    elapsed = time.monotonic() - start
    samples.append((elapsed, server.memory_info().rss))
    previous = samples[-2][1] if len(samples) > 1 else None
    delta = "" if previous is None else f"{(samples[-1][1] - previous) / 2**20:+9.1f}"
    print(f"{elapsed:>9.1f} {samples[-1][1] / 2**20:>9.1f} {delta:>9}", flush=True)


def slow_readers(args: argparse.Namespace, server: psutil.Process) -> list[tuple[float, int]]:
    """Open the never-reading clients; (seconds, RSS) every --sample-seconds for --duration seconds."""
    clients = [never_reading_client(args.port, args.max_tokens) for _ in range(args.concurrency)]
    try:
        start = time.monotonic()
        samples: list[tuple[float, int]] = []
        print(TIME_HEADER, flush=True)
        while True:
            sample_now(server, start, samples)
            if samples[-1][0] >= args.duration:
                return samples
            time.sleep(args.sample_seconds)
    finally:
        for client in clients:
            client.close()


async def surfaces_soak(
    args: argparse.Namespace, target: soak_surfaces.Target, server: psutil.Process
) -> tuple[list[tuple[float, int]], soak_surfaces.Tally]:
    """Exercise the surfaces for --duration seconds while sampling the RSS every --sample-seconds."""
    tally = soak_surfaces.Tally()
    start = time.monotonic()
    load = asyncio.create_task(soak_surfaces.exercise(target, tally, start + args.duration))
    samples: list[tuple[float, int]] = []
    print(TIME_HEADER, flush=True)
    while not load.done():
        sample_now(server, start, samples)
        await asyncio.wait({load}, timeout=args.sample_seconds)
    await load
    sample_now(server, start, samples)  # after the last operation
    return samples, tally


def run_surfaces(args: argparse.Namespace) -> int:
    """--surfaces: the server with keys, runtime LoRA and keyed KV events; the soak; the summary. 1 on errors."""
    endpoint, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    with model_source(args) as model_args, tempfile.TemporaryDirectory(prefix="soak-lora-") as tmp:
        adapter = make_tiny_lora(Path(model_args[0]), Path(tmp) / "lora", rank=soak_surfaces.LORA_RANK)
        flags = soak_surfaces.serve_flags(endpoint, replay)
        with running_server(model_args, args, flags, capture_log=True) as server:
            certificate = soak_surfaces.certificate_in(server.log_tail(100_000))
            if certificate is None:
                print("the server logged no KV events certificate", file=sys.stderr)
                return 1
            target = soak_surfaces.Target(server.base_url, MODEL_NAME, adapter, endpoint, replay, certificate)
            samples, tally = asyncio.run(surfaces_soak(args, target, psutil.Process(server.process.pid)))
    after = [sample for sample in samples if sample[0] >= args.warmup_seconds] or samples[-1:]
    first, last = after[0], samples[-1]
    print(
        f"surfaces: RSS {first[1] / 2**20:.1f} MB at {first[0]:.0f} s, {last[1] / 2**20:.1f} MB at "
        f"{last[0]:.0f} s: growth {(last[1] - first[1]) / 2**20:+.1f} MB"
    )
    print("operations: " + " ".join(f"{name}={count}" for name, count in tally.ops.items()))
    print(f"errors: {len(tally.errors)}", *tally.errors[:20], sep="\n")
    return 1 if tally.errors or 0 in tally.ops.values() else 0


def growth_per_1000(samples: list[Sample], warmup: int) -> float | None:
    """RSS growth in MB per 1,000 requests between the first sample at or after `warmup` and the last."""
    after = [sample for sample in samples if sample.requests >= warmup]
    if len(after) < 2 or after[-1].requests == after[0].requests:
        return None
    grown = (after[-1].rss_bytes - after[0].rss_bytes) / 2**20
    return grown * 1000 / (after[-1].requests - after[0].requests)


HEADER = f"{'requests':>9} {'RSS MB':>9} {'delta MB':>9}"


def row(sample: Sample, previous: Sample | None) -> str:
    """One table row: requests, RSS and the change since the previous sample, in MB."""
    delta = "" if previous is None else f"{(sample.rss_bytes - previous.rss_bytes) / 2**20:+9.1f}"
    cache = "" if sample.cache_bytes is None else f" {sample.cache_bytes / 2**20:>9.2f} cache MB"
    return f"{sample.requests:>9} {sample.rss_bytes / 2**20:>9.1f} {delta:>9}{cache}"


def table(samples: list[Sample]) -> str:
    """The whole table of `samples`."""
    return "\n".join([HEADER, *(row(s, p) for p, s in zip([None, *samples], samples, strict=False))])


def main(argv: list[str] | None = None) -> int:
    """Run the soak and print the RSS table and the growth after warm-up."""
    args = parse_args(argv)
    if args.surfaces:
        return run_surfaces(args)
    if args.slow_reader:
        with model_source(args) as model_args, running_server(model_args, args) as server:
            watched = slow_readers(args, psutil.Process(server.process.pid))
        grown = (max(rss for _, rss in watched) - watched[0][1]) / 2**20
        print(f"slow readers: RSS peak {grown:+.1f} MB over the start")
        return 0
    with model_source(args) as model_args, running_server(model_args, args) as server:
        samples = asyncio.run(soak(args, psutil.Process(server.process.pid)))
    growth = growth_per_1000(samples, args.warmup)
    if growth is None:
        print(f"growth after warm-up: not measured (fewer than two samples after {args.warmup} requests)")
    else:
        print(f"growth after {args.warmup} warm-up requests: {growth:+.2f} MB per 1,000 requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
