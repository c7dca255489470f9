"""The dashboard's per-KV-group maps on the real engine: the tiny gemma3 (sliding, full, sliding layers) and the
tiny mistral (every layer sliding) mid-decode: one map per group, a window's group holding only the blocks its
window sees (the ones it left behind cached, evictable), the null block reserved and owned by nobody."""

from __future__ import annotations

from pathlib import Path

import pytest
from pagoda.server.dashboard.encoder import OTHER, OWNED, RESERVED, encode_replica, expand_runs
from pagoda.server.dashboard.snapshot import replica_snapshot
from pagoda.server.llm import LLM
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import SLIDING_WINDOW, make_tiny_model

BS = 4
WINDOW_BLOCKS = -(-SLIDING_WINDOW // BS) + 1  # the most blocks a window group holds after a decode step
PROMPT = [3 + (7 * i) % 290 for i in range(40)]  # 10 full blocks of 4, five windows of 8


@pytest.mark.parametrize(("arch", "windows"), [("gemma3", (None, 8, 8)), ("mistral", (8,))])
def test_each_group_has_a_map_and_the_window_frees_blocks(
    tmp_path: Path, arch: str, windows: tuple[int | None, ...]
) -> None:
    llm = LLM(
        str(make_tiny_model(arch, tmp_path / arch)),
        block_size=BS,
        num_kv_blocks=128,
        max_model_len=64,
        dtype="float32",
    )
    engine = llm.engine
    engine.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for _ in range(3):  # the prefill, then two decodes
        engine.step()
    snap = replica_snapshot(engine)
    assert snap is not None
    frame = encode_replica(snap)
    states = expand_runs(frame["map"])
    assert len(states) == frame["num_blocks"] and states[0] == RESERVED  # the null block, id 0
    assert expand_runs(frame["refs"])[0] == 0
    groups = frame["groups"]
    assert tuple(g["sliding_window"] for g in groups) == windows
    tables = [_ids(frame["group_tables"][g["group"]]["r"]) for g in groups]
    for g, ids in zip(groups, tables, strict=True):
        mine = expand_runs(g["map"])
        assert all(mine[b] == OWNED for b in ids) and g["counts"]["owned"] == len(ids)
        theirs = {b for other in tables if other is not ids for b in other}
        assert all(mine[b] == OTHER for b in theirs)  # another group's blocks, drawn apart
        if g["sliding_window"] is None:
            assert len(ids) == -(-(len(PROMPT) + 2) // BS)  # every block of the sequence
        else:
            assert len(ids) <= WINDOW_BLOCKS  # only the window's blocks...
            assert g["counts"]["cached"] > 0  # ...the ones behind it are freed, still prefix-cache hits
    # A block belongs to one group at a time: the device map owns exactly the union of the tables.
    assert frame["counts"]["owned"] == sum(map(len, tables)) == len({b for t in tables for b in t})
    engine.abort_request("r")


def _ids(runs: list[int]) -> list[int]:
    """The block ids of `id_runs` output."""
    return [runs[k] + j for k in range(0, len(runs), 2) for j in range(runs[k + 1])]
