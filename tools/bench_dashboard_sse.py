"""The dashboard's viewers against the engine: does watching slow it, does a slow viewer grow the server?

    .venv/bin/python tools/bench_dashboard_sse.py                 # tiny random Llama, a few minutes
    .venv/bin/python tools/bench_dashboard_sse.py --model PATH    # any model folder

Starts `pagoda serve` (pagoda.server.testing.LiveServer) and runs the same workload (`--requests` completions of
`--max-tokens` tokens, `--concurrency` at a time, ignore_eos) in rounds that alternate between no viewer and
`--viewers` viewers reading /dashboard/events (which of the two comes first alternates too); prints each round's
output tokens/s and mean inter-token latency (the engine's decode step time as the server's
`inter_token_latency_seconds` histogram records it, from /metrics read before and after the round) and the frames
the viewers received. Then it keeps the workload running for `--slow-seconds` three times: alone, beside `--slow`
connections to /dashboard/events that never read a byte, and alone again; and prints the server's RSS (psutil)
after each.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
from pagoda.server.testing import LiveServer, make_tiny_model

KEY = "sk-bench"
AUTH = {"Authorization": f"Bearer {KEY}"}


def itl_totals(base_url: str) -> tuple[float, float]:
    """The server's inter-token latency histogram: (sum of seconds, count), summed over its series."""
    text = httpx.get(f"{base_url}/metrics", headers=AUTH, timeout=60).text
    total = {"_sum": 0.0, "_count": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        for suffix in total:
            if name.endswith(":inter_token_latency_seconds" + suffix):
                total[suffix] += float(line.rsplit(" ", 1)[1])
    return total["_sum"], total["_count"]


def measured(base_url: str, requests: int, max_tokens: int, concurrency: int) -> tuple[float, float]:
    """One round's output tokens/s and mean inter-token latency (ms)."""
    sum0, count0 = itl_totals(base_url)
    tps = workload(base_url, requests, max_tokens, concurrency)
    sum1, count1 = itl_totals(base_url)
    return tps, 1000 * (sum1 - sum0) / max(1.0, count1 - count0)


def workload(base_url: str, requests: int, max_tokens: int, concurrency: int) -> float:
    """Output tokens per second of one round."""
    body = {"model": "bench", "prompt": "tell me a story " * 8, "max_tokens": max_tokens, "ignore_eos": True}

    def one(_: int) -> int:
        r = httpx.post(f"{base_url}/v1/completions", json=body, headers=AUTH, timeout=600)
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, range(requests)))
    return tokens / (time.perf_counter() - t0)


def viewer(base_url: str, stop: threading.Event, frames: list[int]) -> None:
    """Read frames until `stop`."""
    with (
        httpx.Client(timeout=60) as client,
        client.stream("GET", f"{base_url}/dashboard/events", headers=AUTH) as r,
    ):
        for line in r.iter_lines():
            if line.startswith("data: "):
                frames[0] += 1
                frames[1] += len(line)
            if stop.is_set():
                return


def frame_size(base_url: str) -> tuple[int, int]:
    """The bytes of one frame's JSON and its replica's block count."""
    with (
        httpx.Client(timeout=60) as client,
        client.stream("GET", f"{base_url}/dashboard/events", headers=AUTH) as r,
    ):
        for line in r.iter_lines():
            if line.startswith("data: ") and '"type":"frame"' in line:
                frame = json.loads(line[len("data: ") :])
                return len(line), int(frame["replicas"][0]["num_blocks"])
    raise RuntimeError("the event stream ended")


def never_reading(port: int) -> socket.socket:
    """A connection that asks for the event stream and then reads nothing."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    head = f"GET /dashboard/events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n"
    sock.sendall(head.encode())
    return sock


def main(argv: list[str] | None = None) -> None:
    """Run the rounds and print the numbers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--viewers", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--slow", type=int, default=10)
    parser.add_argument("--slow-seconds", type=float, default=60.0)
    parser.add_argument(
        "--kv-cache-gib", type=float, default=0.05, help="the KV pool (larger: more blocks, larger frames)"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_tiny_model("llama", Path(tmp) / "llama", max_position_embeddings=4096)
        flags = ["--api-key", KEY, "--kv-cache-gib", str(args.kv_cache_gib), "--dtype", "float32"]
        with LiveServer(model, flags, served_model_name="bench") as server:
            proc = psutil.Process(server.process.pid)
            workload(server.base_url, 4, 16, 4)  # warm-up
            size, blocks = frame_size(server.base_url)
            print(f"a frame: {size / 1024:.1f} KiB of JSON at rest, {blocks} blocks")
            base, watched, frames_seen, frame_bytes = [], [], [], []
            for i in range(args.rounds):
                # The order alternates (a round with viewers first every other time): a drift of the machine's
                # load, or a warming cache, then weighs on both alike.
                if i % 2 == 0:
                    base.append(measured(server.base_url, args.requests, args.max_tokens, args.concurrency))
                stop, frames = threading.Event(), [0, 0]  # frames read, their bytes
                threads = [
                    threading.Thread(target=viewer, args=(server.base_url, stop, frames), daemon=True)
                    for _ in range(args.viewers)
                ]
                for t in threads:
                    t.start()
                time.sleep(1.0)
                watched.append(measured(server.base_url, args.requests, args.max_tokens, args.concurrency))
                stop.set()
                for t in threads:
                    t.join(30)
                frames_seen.append(frames[0])
                frame_bytes.append(frames[1])
                if i % 2 == 1:
                    base.append(measured(server.base_url, args.requests, args.max_tokens, args.concurrency))
            for name, rounds in (("no viewer", base), (f"{args.viewers} viewers", watched)):
                tps, itl = [r[0] for r in rounds], [r[1] for r in rounds]
                print(
                    f"{name}: output tok/s {[round(x, 1) for x in tps]} (median {statistics.median(tps):.1f}), "
                    f"mean ITL ms {[round(x, 2) for x in itl]} (median {statistics.median(itl):.2f})"
                )
            ratio = statistics.median(r[0] for r in watched) / statistics.median(r[0] for r in base)
            print(
                f"tok/s with / without viewers: {ratio:.2f}; frames the viewers read per round: {frames_seen}"
            )
            mean_frame = sum(frame_bytes) / max(1, sum(frames_seen))
            print(f"a frame under this load: {mean_frame / 1024:.1f} KiB on average")
            rss0 = proc.memory_info().rss
            deadline = time.monotonic() + args.slow_seconds
            while time.monotonic() < deadline:
                workload(server.base_url, args.requests, args.max_tokens // 4, args.concurrency)
            rss_plain = proc.memory_info().rss
            slow = [never_reading(server.port) for _ in range(args.slow)]
            deadline = time.monotonic() + args.slow_seconds
            while time.monotonic() < deadline:
                workload(server.base_url, args.requests, args.max_tokens // 4, args.concurrency)
            rss_slow = proc.memory_info().rss
            for sock in slow:
                sock.close()
            deadline = time.monotonic() + args.slow_seconds
            while time.monotonic() < deadline:
                workload(server.base_url, args.requests, args.max_tokens // 4, args.concurrency)
            rss_after = proc.memory_info().rss
            mib = 1024 * 1024
            print(
                f"server RSS: {rss0 / mib:.0f} MiB at start, {rss_plain / mib:.0f} MiB after {args.slow_seconds:g} s "
                f"of load, {rss_slow / mib:.0f} MiB after {args.slow_seconds:g} s more with {args.slow} viewers "
                f"that never read, {rss_after / mib:.0f} MiB after {args.slow_seconds:g} s more without them"
            )


if __name__ == "__main__":
    main()
