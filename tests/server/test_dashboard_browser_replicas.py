"""The dashboard in headless chromium over two engine-core replicas of the tiny gemma3 (sliding, full, sliding
layers): one map per replica side by side, each drawn as one map per KV cache group, a request on each replica
showing used blocks in both, and none once they finished. Without chromium this fails (cdp.chromium_path).
PAGODA_DASHBOARD_REPLICAS_SCREENSHOT=path keeps the screenshot (the README's docs/dashboard-replicas.png)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from cdp import Browser
from dashboard_support import KEY, generating
from pagoda.server.testing import make_tiny_model
from test_api_live import LiveServer, serving

AUTH = {"Authorization": f"Bearer {KEY}"}
READY_S = 300  # two engine-core processes start a fresh interpreter each on a busy machine
PROMPT = " ".join(f"w{i}" for i in range(40))


def _counts(replica: int) -> str:
    """The JS expression of the states replica `replica`'s map decoded (null before its first frame)."""
    return (
        "(window.pagodaDashboard && window.pagodaDashboard.frames > 0 && "
        f"document.querySelectorAll('#replicas .replica').length > {replica}) ? "
        f"window.pagodaDashboard.decodedCounts({replica}) : null"
    )


# Tokens a request may run for (the 2,048-token context less the prompt): aborted once the page showed both maps.
LONG = 1800

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """Two gemma3 engine-core replicas, round robin: consecutive requests land on both."""
    model = make_tiny_model(
        "gemma3", tmp_path_factory.mktemp("tiny") / "gemma3", max_position_embeddings=4096
    )
    flags = ("--api-key", KEY, "--max-model-len", "2048", "--max-num-seqs", "8", "--log-level", "info")
    with serving(
        Path(model),
        *flags,
        "--data-parallel-size",
        "2",
        "--routing-policy",
        "round_robin",
        ready_timeout=READY_S,
    ) as server:
        yield server


@pytest.mark.timeout(900)
def test_two_replicas_side_by_side_with_a_map_per_kv_group(live: LiveServer, tmp_path: Path) -> None:
    with Browser() as browser:
        browser.navigate(f"{live.base_url}/dashboard?api_key={KEY}")
        browser.wait_for(_counts(1))  # both replicas' maps arrived
        with (
            generating(live.base_url, AUTH, "one " + PROMPT, LONG),
            generating(live.base_url, AUTH, "two " + PROMPT, LONG),
        ):
            both = browser.wait_for(
                f"(() => {{ const a = {_counts(0)}, b = {_counts(1)}; return a && b && a.owned > 0 && b.owned > 0"
                " && [a, b]; })()"
            )
            assert all(c["owned"] > 0 for c in both)
            replicas = browser.evaluate(
                "[...document.querySelectorAll('#replicas .replica')].map((r) => ({"
                " title: r.querySelector('h2').textContent,"
                " labels: [...r.querySelectorAll('.group-label')].map((l) => l.textContent),"
                " groupMaps: [...r.querySelectorAll('.groups canvas.map')].filter((c) => c.offsetHeight > 0).length,"
                " oneMapHidden: r.querySelector(':scope > canvas.map').hidden,"
                " top: Math.round(r.getBoundingClientRect().top) }))"
            )
            assert [r["title"].split(" —")[0] for r in replicas] == ["Replica 0", "Replica 1"]
            assert replicas[0]["top"] == replicas[1]["top"]  # side by side
            for r in replicas:
                assert r["groupMaps"] == 3 and r["oneMapHidden"]  # one map per KV cache group instead of one
                full, *windows = r["labels"]
                assert "full attention" in full and all("sliding window 8 tokens" in w for w in windows)
                assert len(windows) == 2
            path = Path(os.environ.get("PAGODA_DASHBOARD_REPLICAS_SCREENSHOT", tmp_path / "replicas.png"))
            path.parent.mkdir(parents=True, exist_ok=True)
            browser.screenshot(path)
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        browser.wait_for(
            f"(() => {{ const a = {_counts(0)}, b = {_counts(1)}; return a && b && a.owned + b.owned === 0"
            " && a.cached > 0 && b.cached > 0; })()"
        )
