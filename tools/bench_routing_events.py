"""After an eviction, which router is right? `--routing-kv-events` against the approximate index on the real server.

    .venv/bin/python tools/bench_routing_events.py          # tiny random Llama, two DP=2 servers in turn, ~2 min

Each server (`--data-parallel-size 2`, cache_aware, a small KV pool of `--kv-blocks` blocks per replica) gets the
same requests one at a time: `--prefixes` system prompts of 8 blocks twice (the second round hits), then
`--fillers` long distinct prompts that make both replicas evict, then the system prompts a third time. For that
third round it prints the hits the router claimed (`router_prefix_hits_total`), the requests the engines really
served from their caches (`cached_tokens` > 0) and the prefix-cache hit rate: a router is right when it claims
exactly the hits the caches give. The approximate index never hears of the evictions; the events router does.
`--routers events` (or `approximate`) starts only that one's server: a smoke run in half the time.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import httpx
from pagoda.server.testing import LiveServer, make_tiny_model

BLOCK = 16
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * BLOCK  # layers x (K, V) x kv heads x head dim x float32, per token x block
ROUTERS = {"approximate": "approximate index", "events": "events"}  # --routers: their names in the table


def metric(base_url: str, name: str) -> float:
    """The sum of every series of `name` in /metrics."""
    total = 0.0
    for line in httpx.get(f"{base_url}/metrics", timeout=60).text.splitlines():
        if line.split("{", 1)[0].split(" ", 1)[0] == name:
            total += float(line.rsplit(" ", 1)[1])
    return total


def complete(base_url: str, prompt: list[int]) -> int:
    """One greedy token; the prompt tokens its replica served from its cache."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    # A moment for the replicas' KV events to reach the router before the next request (they are batched
    # every 10 ms): the comparison is of what each router knows, not of a race.
    time.sleep(0.2)
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def run(model: Path, flags: list[str], args: argparse.Namespace) -> dict[str, float]:
    """The third round's numbers on one server."""
    # Token ids under the tiny model's 400; every prompt's first block differs, so chains never meet.
    prefixes = [[3 + (p * 37 + j) % 300 for j in range(8 * BLOCK)] for p in range(args.prefixes)]
    fillers = [
        [310 + f] + [5 + (f * 11 + j * 7) % 390 for j in range(15 * BLOCK - 1)] for f in range(args.fillers)
    ]
    gib = (args.kv_blocks + 0.5) * BLOCK_BYTES / 2**30  # the half block: no float rounding down to one less
    base = [
        "--data-parallel-size",
        "2",
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--kv-cache-gib",
        f"{gib}",
    ]
    with LiveServer(model, [*base, *flags], served_model_name="bench", ready_timeout=600) as server:
        url = server.base_url
        for round_ in (0, 1):
            for p, prefix in enumerate(prefixes):
                complete(url, [*prefix, *[200 + round_ * 20 + p] * BLOCK])
        for filler in fillers:
            complete(url, filler)
        hits0 = metric(url, "pagoda:router_prefix_hits_total")
        queries0 = metric(url, "pagoda:prefix_cache_queries_total")
        cached0 = metric(url, "pagoda:prefix_cache_hits_total")
        served = sum(complete(url, [*prefix, *[300 + p] * BLOCK]) > 0 for p, prefix in enumerate(prefixes))
        queries = metric(url, "pagoda:prefix_cache_queries_total") - queries0
        return {
            "router hits claimed": metric(url, "pagoda:router_prefix_hits_total") - hits0,
            "requests served from a cache": float(served),
            "prefix-cache hit rate": (metric(url, "pagoda:prefix_cache_hits_total") - cached0)
            / max(1.0, queries),
        }


def main(argv: list[str] | None = None) -> None:
    """Both servers (or those of --routers) in turn; one table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--prefixes", type=int, default=6)
    parser.add_argument("--fillers", type=int, default=4)
    parser.add_argument("--kv-blocks", type=int, default=48)
    parser.add_argument(
        "--routers",
        nargs="+",
        choices=ROUTERS,
        default=list(ROUTERS),
        help="the servers to run, in this order",
    )
    args = parser.parse_args(argv)
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "ipc://{dir}/kv"})
    with tempfile.TemporaryDirectory(prefix="kvrt", dir="/tmp") as tmp:
        model = args.model or make_tiny_model("llama", Path(tmp) / "llama", max_position_embeddings=4096)
        flags = {
            "approximate": [],
            "events": ["--routing-kv-events", "--kv-events-config", events.replace("{dir}", tmp)],
        }
        results = {ROUTERS[router]: run(model, flags[router], args) for router in args.routers}
    print(
        f"third round: {args.prefixes} system prompts after {args.fillers} fillers, {args.kv_blocks} blocks each"
    )
    for name, numbers in results.items():
        print(f"  {name:18s} " + ", ".join(f"{k} {v:.3g}" for k, v in numbers.items()))


if __name__ == "__main__":
    main()
