"""The dashboard per key (#43, finding 7), on the real server: while two keys' requests run, each key's stream
shows the anonymous block map and only its own queue rows and block tables; the admin key's shows both."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from dashboard_support import generating, wait_for_frame
from pagoda.server.testing import make_tiny_model
from test_api_live import LiveServer

ALICE, BOB, ADMIN = "sk-dash-alice", "sk-dash-bob", "sk-dash-admin"
MAX_LEN = 16384
LONG = MAX_LEN - 512  # tokens a request may run for: far longer than the test waits (it is aborted)


def auth(key: str) -> dict[str, str]:
    """The bearer header of `key`."""
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """Two tenant keys and an admin key."""
    model = make_tiny_model(
        "llama", tmp_path_factory.mktemp("tiny") / "llama", max_position_embeddings=MAX_LEN
    )
    flags = ["--api-key", ALICE, "--api-key", BOB, "--admin-api-key", ADMIN, "--max-model-len", str(MAX_LEN)]
    server = LiveServer(model, *flags)
    try:
        yield server
    finally:
        assert server.stop() == 0


def rows(frame: dict[str, Any]) -> list[list[Any]]:
    """Every queue row of replica 0."""
    queues = frame["replicas"][0]["queues"]
    return [row for name in ("running", "waiting", "swapped") for row in queues[name]]


def test_each_key_sees_its_own_requests_and_the_admin_all(live: LiveServer) -> None:
    with (
        generating(live.base_url, auth(ALICE), "alice " * 30, LONG),
        generating(live.base_url, auth(BOB), "bob " * 30, LONG),
    ):
        admin = wait_for_frame(
            live.base_url, auth(ADMIN), lambda f: len(f["replicas"][0]["queues"]["running"]) == 2
        )
        assert len(admin["replicas"][0]["tables"]) == 2
        views = {}
        for key in (ALICE, BOB):
            # A frame while both still run: the anonymous map counts both requests' blocks.
            frame = wait_for_frame(live.base_url, auth(key), lambda f: f["stats"]["running"] == 2)
            views[key] = frame
            mine = rows(frame)
            assert len(mine) == 1, mine
            assert len(frame["replicas"][0]["tables"]) == 1
            assert set(frame["replicas"][0]["tables"]) == {mine[0][0]}
            assert frame["replicas"][0]["counts"]["owned"] >= 2  # the map is whole
    assert rows(views[ALICE])[0][0] != rows(views[BOB])[0][0]
    assert {rows(views[ALICE])[0][0], rows(views[BOB])[0][0]} == {row[0] for row in rows(admin)}


def test_owners_keep_a_request_until_a_frame_has_shown_it_and_it_left() -> None:
    """RequestOwners: an engine core's map can lag its requests by many frames (a loaded core answers late), so a
    request no frame has shown yet stays owned (up to `unseen_s`); once shown, two frames without it forget it."""
    from pagoda.server.dashboard.tenants import CALLER, RequestOwners

    owners = RequestOwners(unseen_s=10.0)
    token = CALLER.set("alice")
    try:
        owners.add(["a", "b"], now=0.0)
    finally:
        CALLER.reset(token)
    for t in range(8):  # eight lagging frames show neither
        owners.keep_only(set(), now=float(t))
    assert owners.owned_by("alice") == {"a", "b"}
    owners.keep_only({"a:0"}, now=8.0)  # `a` shown (a sequence of it), `b` still not
    owners.keep_only(set(), now=9.0)
    assert owners.owned_by("alice") == {"a", "b"}
    owners.keep_only(set(), now=9.5)  # `a` missing from two frames after it was shown: finished
    assert owners.owned_by("alice") == {"b"}
    owners.keep_only(set(), now=11.0)  # `b` never shown in 10 s (finished between two frames): forgotten
    assert owners.owned_by("alice") == set() and owners.owned_by("bob") == set()
