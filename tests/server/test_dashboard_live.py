"""/dashboard and /dashboard/events on the real server (tiny model, a key): auth, and the block map while
requests run, share blocks (n = 4, a repeated prefix) and finish."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from dashboard_support import KEY, counts, generating, wait_for_frame
from pagoda.server.testing import make_tiny_model
from test_api_live import LiveServer

AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = " ".join(f"w{i}" for i in range(40))  # about 150 tokens: several blocks of 16
MAX_LEN = 16384
LONG = MAX_LEN - 512  # tokens a request may run for: far longer than any test waits (each is aborted)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model = make_tiny_model(
        "llama", tmp_path_factory.mktemp("tiny") / "llama", max_position_embeddings=MAX_LEN
    )
    server = LiveServer(model, "--api-key", KEY, "--max-model-len", str(MAX_LEN), "--log-level", "info")
    try:
        yield server
    finally:
        assert server.stop() == 0


def test_without_the_key_a_401_and_no_data(live: LiveServer) -> None:
    for path in ("/dashboard", "/dashboard/events", "/dashboard/dashboard.js"):
        r = httpx.get(live.base_url + path, timeout=30)
        assert r.status_code == 401, path
        assert r.json()["error"]["message"] == "Missing or invalid API key."
        assert "data:" not in r.text
    wrong = httpx.get(f"{live.base_url}/dashboard?api_key=sk-wrong", timeout=30, follow_redirects=False)
    assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
    bad_cookie = httpx.get(f"{live.base_url}/dashboard", cookies={"pagoda_dashboard_key": "nope"}, timeout=30)
    assert bad_cookie.status_code == 401


def test_bearer_loads_the_page_and_sets_the_cookie(live: LiveServer) -> None:
    r = httpx.get(f"{live.base_url}/dashboard", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "<canvas" in r.text or "dashboard.js" in r.text
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/dashboard" in cookie
    js = httpx.get(f"{live.base_url}/dashboard/dashboard.js", headers=AUTH, timeout=30)
    assert js.status_code == 200 and "EventSource" in js.text


def test_query_key_sets_a_cookie_redirects_to_the_clean_url_and_is_never_logged(live: LiveServer) -> None:
    with httpx.Client(base_url=live.base_url, timeout=30) as client:
        r = client.get("/dashboard", params={"api_key": KEY, "view": "compact"}, follow_redirects=False)
        assert r.status_code == 303
        assert r.headers["location"] == "/dashboard?view=compact"
        cookie = r.headers["set-cookie"]
        assert cookie.startswith("pagoda_dashboard_key=")
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
        page = client.get("/dashboard")  # the client now carries the cookie alone
        assert page.status_code == 200
        with client.stream("GET", "/dashboard/events") as events:
            assert events.status_code == 200
            first = next(line for line in events.iter_lines() if line.startswith("data: "))
            assert '"type": "history"' in first or '"type":"history"' in first
    log = live.log_tail(2000)
    assert "GET /dashboard" in log  # the access log is on, and shows the requests...
    assert KEY not in log  # ...without the key


def test_map_shows_used_blocks_while_running_and_none_after(live: LiveServer) -> None:
    with generating(live.base_url, AUTH, PROMPT, LONG):
        running = wait_for_frame(
            live.base_url,
            AUTH,
            lambda f: bool(f["replicas"][0]["queues"]["running"]) and counts(f)["owned"] > 0,
        )
    replica = running["replicas"][0]
    (row,) = replica["queues"]["running"]
    request_id, computed, total, prompt_len = row[:4]
    assert computed <= total and prompt_len > 16
    assert request_id in replica["tables"]
    idle = wait_for_frame(
        live.base_url,
        AUTH,
        lambda f: not f["replicas"][0]["queues"]["running"] and f["stats"]["running"] == 0,
    )
    c = counts(idle)
    assert c["owned"] == 0 and c["shared"] == 0 and c["swapped"] == 0
    assert c["cached"] > 0  # the prompt's full blocks stay prefix-cache hits
    assert idle["replicas"][0]["tables"] == {}


def test_n4_and_a_repeated_prefix_show_shared_blocks(live: LiveServer) -> None:
    with generating(live.base_url, AUTH, "fork " + PROMPT, LONG, n=4, temperature=1.0):
        frame = wait_for_frame(live.base_url, AUTH, lambda f: counts(f)["shared"] > 0)
    refs = frame["replicas"][0]["refs"]
    assert max(refs[0::2]) >= 4  # the prompt's blocks are held by all four samples
    wait_for_frame(live.base_url, AUTH, lambda f: f["stats"]["running"] == 0)
    prefix = "shared system prompt " + PROMPT
    with generating(live.base_url, AUTH, prefix + " question one", LONG):
        wait_for_frame(live.base_url, AUTH, lambda f: f["stats"]["running"] == 1)
        with generating(live.base_url, AUTH, prefix + " question two", LONG):
            frame = wait_for_frame(
                live.base_url, AUTH, lambda f: f["stats"]["running"] == 2 and counts(f)["shared"] > 0
            )
    tables = frame["replicas"][0]["tables"]
    assert len(tables) == 2
    a, b = tables.values()
    assert a[0] == b[0]  # both tables start at the same (shared) block
