"""The dashboard's KV tier panel in headless chromium (issue 39): with a host tier, a pool too small for five long
prompts evicts the first, which then comes back from the tier; the panel shows the host tier's occupancy and the
blocks it served as the frames report them, and the tier charts appear. Without chromium this fails
(cdp.chromium_path)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import pytest
from cdp import Browser
from dashboard_support import KEY
from pagoda.server.testing import make_tiny_model
from test_api_live import LiveServer

AUTH = {"Authorization": f"Bearer {KEY}"}
HOST_TIER = (
    "(window.pagodaDashboard && window.pagodaDashboard.last && window.pagodaDashboard.last.stats.kv_tiers[0])"
)

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """About 500 blocks of 16 tokens on the device and a 50 MiB host tier."""
    model = make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama", max_position_embeddings=4096)
    flags = [
        "--api-key",
        KEY,
        "--max-model-len",
        "2048",
        "--kv-cache-gib",
        "0.004",
        "--kv-offloading-size",
        "0.05",
    ]
    server = LiveServer(model, *flags)
    try:
        yield server
    finally:
        assert server.stop() == 0


def _cached(live: LiveServer, prompt: list[int]) -> int:
    """The cached tokens of one short completion of `prompt`."""
    body = {"model": "test-model", "prompt": prompt, "max_tokens": 1}
    r = httpx.post(f"{live.base_url}/v1/completions", json=body, headers=AUTH, timeout=600)
    assert r.status_code == 200, r.text
    cached: int = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


def test_the_tier_panel_shows_occupancy_and_blocks_served(live: LiveServer) -> None:
    prompts = [[random.Random(k).randrange(3, 399) for _ in range(1900)] for k in range(6)]
    for prompt in prompts:
        assert _cached(live, prompt) == 0
    # The first prompt's blocks left the device pool (about 500 blocks) but not the tier.
    assert _cached(live, prompts[0]) == 1888
    with Browser() as browser:
        browser.navigate(f"{live.base_url}/dashboard?api_key={KEY}")
        tier = browser.wait_for(f"{HOST_TIER} && {HOST_TIER}.hits > 0 && {HOST_TIER}")
        assert tier["tier"] == "host" and tier["hits"] == 118  # 1888 / 16 blocks served
        assert 0 < tier["used_bytes"] <= tier["capacity_bytes"]
        row = browser.wait_for(
            "!document.getElementById('tiers').hidden && "
            "document.querySelector('#tier-rows .tier[data-tier=host]').innerText"
        )
        assert "host tier" in row and "118 blocks served" in row
        usage = 100 * tier["used_bytes"] / tier["capacity_bytes"]
        assert f"({usage:.1f}%)" in row
        # The tier charts show once a series point carries the tier (one a second).
        titles = browser.wait_for(
            "(() => { const t = [...document.querySelectorAll('#series .chart')].filter((c) => !c.hidden)"
            ".map((c) => c.querySelector('.title span').textContent); "
            "return t.some((x) => x.startsWith('KV tier')) && t; })()"
        )
        assert "KV tier usage host / disk" in titles and "KV tier hits/s host / disk" in titles
