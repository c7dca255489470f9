"""The dashboard in a real headless browser (Debian's chromium over CDP): the key flow, the block map while
requests run and after, shared blocks, bounded DOM and JS heap over 60 s of frames, and the README screenshot.

Without chromium these tests FAIL (cdp.chromium_path), they never skip: CI installs it (tools/dev.py test).
Set PAGODA_DASHBOARD_SCREENSHOT=path to keep the screenshot (the README's docs/dashboard.png comes from here).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from cdp import Browser
from dashboard_support import KEY, generating, in_background
from pagoda.server.testing import make_tiny_model
from test_api_live import LiveServer

AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = " ".join(f"w{i}" for i in range(40))
COUNTS = (
    "window.pagodaDashboard && window.pagodaDashboard.frames > 0 && window.pagodaDashboard.decodedCounts(0)"
)

# Tokens a request may run for (the 2,048-token context less the prompt): aborted once the page showed its state.
LONG = 1800

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A small pool (about 500 blocks) and a host tier, so that load shows every state."""
    model = make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama", max_position_embeddings=4096)
    flags = ["--api-key", KEY, "--max-model-len", "2048", "--kv-cache-gib", "0.004"]
    server = LiveServer(model, *flags, "--swap-space", "0.001", "--preemption-mode", "swap")
    try:
        yield server
    finally:
        assert server.stop() == 0


@pytest.fixture
def browser() -> Iterator[Browser]:
    with Browser() as b:
        yield b


def _complete(live: LiveServer, prompt: str, max_tokens: int, **extra: Any) -> None:
    body = {"model": "test-model", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}
    r = httpx.post(f"{live.base_url}/v1/completions", json=body, headers=AUTH, timeout=600)
    assert r.status_code == 200, r.text


def _login(browser: Browser, live: LiveServer) -> None:
    browser.navigate(f"{live.base_url}/dashboard?api_key={KEY}")
    browser.wait_for(COUNTS)


def test_page_loads_with_the_key_and_without_it_shows_nothing(browser: Browser, live: LiveServer) -> None:
    browser.navigate(f"{live.base_url}/dashboard")
    assert "Missing or invalid API key" in browser.evaluate("document.body.innerText")
    assert browser.evaluate("typeof window.pagodaDashboard") == "undefined"  # no page, no data
    _login(browser, live)
    assert browser.evaluate("location.href") == f"{live.base_url}/dashboard"  # the key left the URL
    assert browser.evaluate("document.cookie") == ""  # HttpOnly: scripts never see the key
    assert browser.evaluate("document.getElementById('status').textContent") == "live"
    assert browser.evaluate("document.querySelectorAll('canvas.map').length") == 1
    # No KV tier on this server: no tier panel, no tier charts (the 7 charts, and the step shape and SLO
    # attainment of the scheduling profiles).
    assert browser.evaluate("document.getElementById('tiers').hidden")
    assert (
        browser.evaluate("[...document.querySelectorAll('#series .chart')].filter((c) => !c.hidden).length")
        == 9
    )


def test_map_shows_used_blocks_while_requests_run_and_none_after(browser: Browser, live: LiveServer) -> None:
    _login(browser, live)
    with generating(live.base_url, AUTH, PROMPT, LONG):
        used = browser.wait_for(f"(() => {{ const c = {COUNTS}; return c && c.owned > 0 && c; }})()")
        assert used["owned"] > 0
        assert "Running (1)" in browser.evaluate("document.getElementById('replicas').innerText")
        # Hovering a block shows its state, ref count and owner.
        block = browser.evaluate("window.pagodaDashboard.firstBlock(0, 'owned')")
        assert block >= 0
        pos = browser.evaluate(f"window.pagodaDashboard.blockCenter(0, {block})")
        browser.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": pos["x"], "y": pos["y"]})
        tip = browser.wait_for(
            "!document.getElementById('tip').hidden && document.getElementById('tip').textContent"
        )
        assert f"block {block}: owned, ref count 1" in tip and "held by cmpl-" in tip
    after = browser.wait_for(
        f"(() => {{ const c = {COUNTS}; return c && c.owned + c.shared + c.swapped === 0 && c; }})()"
    )
    assert after["cached"] > 0  # the prompt's blocks stay prefix-cache hits
    assert "Running (0)" in browser.evaluate("document.getElementById('replicas').innerText")


def test_n4_and_a_repeated_prefix_show_shared_blocks(browser: Browser, live: LiveServer) -> None:
    _login(browser, live)
    with generating(live.base_url, AUTH, "fork " + PROMPT, 1000, n=4):
        browser.wait_for(f"(() => {{ const c = {COUNTS}; return c && c.shared > 0; }})()")
    browser.wait_for(f"(() => {{ const c = {COUNTS}; return c && c.shared + c.owned === 0; }})()")
    prefix = "system prompt " + PROMPT
    with generating(live.base_url, AUTH, prefix + " one", LONG):
        browser.wait_for(f"(() => {{ const c = {COUNTS}; return c && c.owned > 0; }})()")
        with generating(live.base_url, AUTH, prefix + " two", LONG):
            browser.wait_for(f"(() => {{ const c = {COUNTS}; return c && c.shared > 0; }})()")


def test_dom_and_heap_stay_bounded_over_60_s_of_frames(browser: Browser, live: LiveServer) -> None:
    _login(browser, live)
    stop = time.monotonic() + 75

    def load() -> None:
        i = 0
        while time.monotonic() < stop:
            i += 1
            _complete(live, f"load {i} " + PROMPT, 60, n=2)

    threads = [in_background(load) for _ in range(3)]
    browser.wait_for("window.pagodaDashboard.frames > 20")
    nodes_before = browser.evaluate("document.getElementsByTagName('*').length")
    heap_before = browser.heap_used()
    frames_before = browser.evaluate("window.pagodaDashboard.frames")
    time.sleep(60)
    frames = browser.evaluate("window.pagodaDashboard.frames") - frames_before
    nodes_after = browser.evaluate("document.getElementsByTagName('*').length")
    heap_after = browser.heap_used()
    for thread in threads:
        thread.join(600)
    assert frames > 60  # the page really received frames all along (4 a second at most)
    # The queue tables change size with the load (at most MAX_ROWS rows per queue): a bound, not equality.
    assert nodes_after <= nodes_before + 3 * 12 * 8
    assert heap_after < heap_before * 1.5 + 2 * 1024 * 1024, (heap_before, heap_after)


def test_screenshot_under_load(browser: Browser, live: LiveServer, tmp_path: Path) -> None:
    _login(browser, live)
    prefix = "system prompt " + PROMPT
    done = False

    def load(i: int) -> None:
        j = 0
        while not done:
            j += 1
            extra: dict[str, Any] = {"n": 4} if i == 0 else {}
            _complete(live, f"{prefix} question {i}.{j}", 1800, **extra)

    threads = [in_background(partial(load, i)) for i in range(4)]
    try:
        browser.wait_for(
            f"(() => {{ const c = {COUNTS}; return c && c.shared > 0 && c.owned > 50"
            " && window.pagodaDashboard.points.length >= 10; })()"
        )
        path = Path(os.environ.get("PAGODA_DASHBOARD_SCREENSHOT", tmp_path / "dashboard.png"))
        browser.screenshot(path)
    finally:
        done = True
        for thread in threads:
            thread.join(600)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
