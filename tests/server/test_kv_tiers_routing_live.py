"""The host KV tier seen from outside a live server (issue 39): two data-parallel replicas with
`--routing-kv-events` publish the tier's blocks (medium CPU_TIER), so after both replicas restarted with empty
device caches the cache-aware router still routes their prefixes as hits; the tier's hits count as cached tokens
in OpenAI's usage and in Anthropic's `cache_read_input_tokens`; /metrics has the per-tier series."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest
from api_cases import MODEL
from pagoda.server.testing import make_tiny_model
from test_api_live import NO_EOS, LiveServer, serving, sync_client
from test_engine_core import CORE_FLAGS, READY_S, _core_pids, engine_metric, metric_value, wait_replicas_alive

PREFIX = [10 + i for i in range(256)]  # 16 full blocks of 16 tokens
QUESTION = " ".join(f"w{i}" for i in range(60))  # a chat prompt of several full blocks


@pytest.fixture(scope="module")
def ipc_dir() -> Iterator[Path]:
    """A short directory for ipc:// endpoints (a socket path is limited to ~100 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="kvtr", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def cached_tokens(live: LiveServer, prompt: list[int]) -> int:
    """usage.prompt_tokens_details.cached_tokens of a greedy completion."""
    out = sync_client(live).completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body=NO_EOS
    )
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    return out.usage.prompt_tokens_details.cached_tokens or 0


def cache_read(client: anthropic.Anthropic) -> tuple[int, int]:
    """(input_tokens, cache_read_input_tokens) of one Messages call."""
    message = client.messages.create(
        model=MODEL,
        max_tokens=2,
        messages=[{"role": "user", "content": QUESTION}],
        extra_body={"temperature": 0.0},
    )
    return message.usage.input_tokens, message.usage.cache_read_input_tokens or 0


def router_counts(live: LiveServer) -> tuple[float, float]:
    """(router_prefix_hits, router_prefix_misses)."""
    text = httpx.get(f"{live.base_url}/metrics").text
    label = '{model_name="' + MODEL + '"}'
    return (
        metric_value(text, "pagoda:router_prefix_hits_total" + label),
        metric_value(text, "pagoda:router_prefix_misses_total" + label),
    )


@pytest.mark.timeout(900)
def test_the_router_knows_the_tier_after_restarts_and_usage_counts_tier_hits(
    ipc_dir: Path, tmp_path: Path
) -> None:
    model = make_tiny_model("llama", tmp_path / "m", max_position_embeddings=4096)
    events = json.dumps(
        {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{ipc_dir}/kv"}
    )
    flags = (
        *CORE_FLAGS,
        "--data-parallel-size",
        "2",
        "--routing-kv-events",
        "--kv-events-config",
        events,
        "--kv-offloading-size",
        "0.05",
    )
    with serving(model, *flags, ready_timeout=READY_S) as live:
        client = anthropic.Anthropic(base_url=live.base_url, api_key="unused", max_retries=0, timeout=120)
        assert cached_tokens(live, [*PREFIX, 300]) == 0
        first_input, first_read = cache_read(client)
        assert first_read == 0 and first_input > 32
        assert router_counts(live) == (0.0, 2.0)
        time.sleep(1.0)  # the tier's events reach the router (published every 10 ms, drained before routing)
        for core in _core_pids(live):
            os.kill(core, signal.SIGKILL)
        time.sleep(1.0)
        wait_replicas_alive(live, 2, READY_S, "the replicas did not come back")
        # Both device caches are empty and the router forgot them: only the tier holds the prefixes.
        assert cached_tokens(live, [*PREFIX, 301]) == 256
        again_input, again_read = cache_read(client)
        assert again_read == (first_input - 1) // 16 * 16 and again_input + again_read == first_input
        assert router_counts(live) == (2.0, 2.0)  # routed as hits (by the tier), not as misses
        text = httpx.get(f"{live.base_url}/metrics").text
        hits = [engine_metric(text, "pagoda:kv_tier_hits_total", e) for e in ("0", "1")]
        assert sum(hits) == 16 + again_read // 16  # blocks loaded from the tier since the restart
        for engine in ("0", "1"):
            used = engine_metric(text, "pagoda:kv_tier_used_bytes", engine)
            capacity = engine_metric(text, "pagoda:kv_tier_capacity_bytes", engine)
            assert 0 < used <= capacity
            assert engine_metric(text, "pagoda:kv_tier_bytes_in_total", engine) >= 0
        assert 'tier="host"' in text
