"""Smoke test of tools/bench_routing_events.py --routers events: one DP=2 server with the KV-events router, two
system prompts and one filler that evicts nothing (a pool of 48 blocks per replica), so that every third-round
prompt hits and the router claims exactly those hits."""

from __future__ import annotations

import re

import pytest
from tool_scripts import load_tool

bench = load_tool("bench_routing_events.py")


def test_events_router_claims_the_hits_the_caches_give(capsys: pytest.CaptureFixture[str]) -> None:
    """Without an eviction both system prompts are served from a cache in the third round, the events router
    claims both hits, and the prefix-cache hit rate is in (0, 1]."""
    bench.main(["--routers", "events", "--prefixes", "2", "--fillers", "1", "--kv-blocks", "48"])
    out = capsys.readouterr().out
    assert "third round: 2 system prompts after 1 fillers, 48 blocks each" in out, out
    assert "approximate index" not in out, out
    line = re.search(
        r"events +router hits claimed (\S+), requests served from a cache (\S+), prefix-cache hit rate (\S+)",
        out,
    )
    assert line, out
    assert float(line[1]) == float(line[2]) == 2 and 0 < float(line[3]) <= 1, out
