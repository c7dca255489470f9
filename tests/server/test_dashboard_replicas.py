"""The dashboard of engine-core replicas: `--data-parallel-size 2` engine-core processes each send their block map
(snapshotted between two of their steps, encoded on a thread of the core), and a frame shows one map per replica."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dashboard_support import KEY, counts, generating, wait_for_frame
from pagoda.server.testing import make_tiny_model
from test_api_live import LiveServer, serving

AUTH = {"Authorization": f"Bearer {KEY}"}
READY_S = 300  # two engine-core processes start a fresh interpreter each on a busy machine
MAX_LEN = 16384
LONG = MAX_LEN - 512  # tokens a request may run for: far longer than the test waits (it is aborted)
FLAGS = ("--max-model-len", str(MAX_LEN), "--max-num-seqs", "8", "--log-level", "info", "--api-key", KEY)


@pytest.fixture(scope="module")
def dp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """Two engine-core replicas, round robin: consecutive requests land on both."""
    model = make_tiny_model(
        "llama", tmp_path_factory.mktemp("tiny") / "llama", max_position_embeddings=MAX_LEN
    )
    flags = (*FLAGS, "--data-parallel-size", "2", "--routing-policy", "round_robin")
    with serving(Path(model), *flags, ready_timeout=READY_S) as live:
        yield live


def _both_busy(frame: dict[str, Any]) -> bool:
    replicas = frame["replicas"]
    return (
        len(replicas) == 2
        and all(r["queues"]["running"] and r["map"] for r in replicas)
        and all(counts(frame, i)["owned"] > 0 for i in range(2))
    )


@pytest.mark.timeout(900)
def test_each_replica_shows_its_own_block_map(dp2: LiveServer) -> None:
    """A request on each replica: both maps show used blocks, each table in its own replica's map; none after."""
    prompt = " ".join(f"w{i}" for i in range(40))
    with (
        generating(dp2.base_url, AUTH, "one " + prompt, LONG),
        generating(dp2.base_url, AUTH, "two " + prompt, LONG),
    ):
        frame = wait_for_frame(dp2.base_url, AUTH, _both_busy)
    replicas = frame["replicas"]
    assert [r["replica"] for r in replicas] == [0, 1]
    for r in replicas:
        ((request_id, *_),) = r["queues"]["running"]
        assert list(r["tables"]) == [request_id]  # the map of the replica running it, and only that one
        assert r["num_blocks"] > 0 and r["block_size"] == 16
    idle = wait_for_frame(
        dp2.base_url,
        AUTH,
        lambda f: len(f["replicas"]) == 2 and all(not r["queues"]["running"] for r in f["replicas"]),
    )
    for i in range(2):
        c = counts(idle, i)
        assert c["owned"] == 0 and c["shared"] == 0 and c["cached"] > 0
        assert idle["replicas"][i]["tables"] == {}


def test_a_core_encodes_one_view_at_a_time_off_its_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """core/block_maps.py: requests while a view is encoded coalesce into it; a failing encode is skipped, and the
    next request snapshots again."""
    import threading

    from pagoda.server.core import block_maps
    from pagoda.server.llm import LLM
    from pagoda.server.sampling_params import SamplingParams

    engine = LLM(
        str(make_tiny_model("llama", tmp_path / "llama")), num_kv_blocks=64, max_model_len=256
    ).engine
    engine.add_request("r", list(range(3, 40)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    gate, calls = threading.Event(), []
    encode = block_maps._encode

    def slow_encode(snap: Any) -> dict[str, Any]:
        calls.append(threading.current_thread().name)
        gate.wait(30)
        if len(calls) == 2:
            raise RuntimeError("a failing view")
        return encode(snap)

    monkeypatch.setattr(block_maps, "_encode", slow_encode)
    views = block_maps.CoreBlockMaps()
    try:
        views.request(engine)
        views.request(engine)  # coalesced: one encode on its way
        encoding = views.pending  # (a local: mypy would keep the property narrowed for the loops below)
        assert encoding and views.take() is None
        gate.set()
        while (view := views.take()) is None:
            pass
        assert list(view["tables"]) == ["r"] and view["counts"]["owned"] > 0
        assert len(calls) == 1 and calls[0].startswith("pagoda-core-dashboard")  # not the loop's thread
        views.request(engine)
        while views.pending:
            assert views.take() is None  # the failing encode gives nothing, and no exception
        views.request(engine)
        while (view := views.take()) is None:
            pass
        assert len(calls) == 3
    finally:
        views.close()
