"""The dashboard's frame encoder: block states, ref counts and tables from allocator snapshots; run lengths."""

from __future__ import annotations

from pagoda.blockalloc import BlockManager
from pagoda.scheduler import QueueEntry, QueueView
from pagoda.server.dashboard.encoder import (
    CACHED,
    FREE,
    OWNED,
    SHARED,
    SWAPPED,
    device_states,
    encode_replica,
    expand_runs,
    host_states,
    id_runs,
    run_length,
)
from pagoda.server.dashboard.latency import LatencyWindow, percentile
from pagoda.server.dashboard.snapshot import ReplicaSnapshot
from pagoda.server.outputs import EngineStats


def _stats(kv: BlockManager) -> EngineStats:
    s = kv.stats()
    return EngineStats(
        num_running=1,
        num_waiting=0,
        num_swapped=0,
        kv_cache_usage=s.usage,
        num_kv_blocks=s.num_blocks,
        block_size=kv.block_size,
        prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits,
        num_preemptions=0,
        prompt_tokens=0,
        generation_tokens=0,
        num_host_blocks=s.num_host_blocks,
    )


def test_run_length_round_trips() -> None:
    values = [0, 0, 3, 3, 3, 1, 0, 2, 2]
    assert run_length(values) == [0, 2, 3, 3, 1, 1, 0, 1, 2, 2]
    assert expand_runs(run_length(values)) == values
    assert run_length([]) == [] and expand_runs([]) == []
    assert id_runs([4, 5, 6, 9, 10, 2]) == [4, 3, 9, 2, 2, 1]


def test_states_of_every_kind() -> None:
    """Owned, shared by a fork, shared by a prefix hit, cached-evictable, swapped and free blocks."""
    kv = BlockManager(num_blocks=12, block_size=4, num_host_blocks=4)
    system = list(range(100, 108))  # two full blocks
    assert kv.allocate_slots("a", [*system, 1, 2], 10) is not None  # blocks 0, 1 (full), 2 (partial)
    cached = kv.get_num_cached_tokens([*system, 7], max_tokens=8)
    assert cached == 8
    assert kv.allocate_slots("b", [*system, 7], 1, num_computed_tokens=8) is not None  # shares 0, 1; new 3
    kv.fork("b", "b:1")  # 0, 1, 3 +1 each
    assert kv.allocate_slots("c", list(range(200, 208)), 8) is not None  # blocks 4, 5 full and hashed
    kv.free("c")  # 4, 5: cached-evictable
    assert kv.allocate_slots("d", list(range(300, 306)), 6) is not None  # blocks 6, 7
    assert kv.swap_out("d") is not None  # host blocks 0, 1; device 6, 7 freed (uncached partial/full?)
    snap = kv.snapshot()
    states = device_states(snap)
    assert states[0] == states[1] == SHARED  # a, b, b:1
    assert states[2] == OWNED  # a's partial block
    assert states[3] == SHARED  # b and its fork
    assert states[4] == states[5] == CACHED
    assert states[6] == CACHED  # d's full block stays a prefix-cache hit after the swap-out
    assert states[7] == FREE and all(s == FREE for s in states[8:])
    assert list(host_states(snap)) == [SWAPPED, SWAPPED, FREE, FREE]

    queues = QueueView(running=(QueueEntry("a", 10, 10, 10, 10, 0),), waiting=(), swapped=())
    frame = encode_replica(ReplicaSnapshot(0, snap, queues, _stats(kv)))
    assert expand_runs(frame["map"]) == list(states)
    assert expand_runs(frame["refs"]) == [3, 3, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0]
    assert frame["counts"] == {"free": 5, "cached": 3, "owned": 1, "shared": 3, "swapped": 2}
    assert frame["tables"] == {"a": [0, 3], "b": [0, 2, 3, 1], "b:1": [0, 2, 3, 1]}
    assert frame["swapped_tables"] == {"d": [0, 2]}
    assert frame["queues"]["running"] == [["a", 10, 10, 10, 10, 0]]
    assert frame["num_blocks"] == 12 and frame["num_host_blocks"] == 4


def test_kv_cache_groups_get_a_map_each() -> None:
    """A full and a sliding-window group: the null block is RESERVED, each group's map shows its own blocks (the
    other group's as OTHER), and the window's map holds fewer blocks than the full one as the sequence grows."""
    from pagoda.blockalloc import FULL_ATTENTION, KVCacheGroupSpec
    from pagoda.server.dashboard.encoder import OTHER, RESERVED

    kv = BlockManager(
        num_blocks=16, block_size=4, groups=(FULL_ATTENTION, KVCacheGroupSpec(sliding_window=4))
    )
    tokens = list(range(20))
    assert kv.allocate_slots("a", tokens[:8], 8) is not None
    assert kv.allocate_slots("a", tokens, 12, num_computed_tokens=8) is not None
    snap = kv.snapshot()
    queues = QueueView(running=(QueueEntry("a", 20, 20, 8, 12, 0),), waiting=(), swapped=())
    frame = encode_replica(ReplicaSnapshot(0, snap, queues, _stats(kv)))
    states = expand_runs(frame["map"])
    assert frame["num_blocks"] == 16 == len(states) and states[0] == RESERVED
    assert frame["counts"]["reserved"] == 1
    full, window = frame["groups"]
    assert (full["group"], full["sliding_window"], window["sliding_window"]) == (0, None, 4)
    full_map, window_map = expand_runs(full["map"]), expand_runs(window["map"])
    full_ids = expand_id_runs(frame["group_tables"][0]["a"])
    window_ids = expand_id_runs(frame["group_tables"][1]["a"])
    assert len(full_ids) == 5 and 0 < len(window_ids) < 5  # the window released the blocks behind it
    assert all(full_map[i] == OWNED and window_map[i] == OTHER for i in full_ids)
    assert all(window_map[i] == OWNED and full_map[i] == OTHER for i in window_ids)
    assert full["counts"]["owned"] == 5 and window["counts"]["owned"] == len(window_ids)
    # The blocks the window left behind stay prefix-cache hits of the window's group, evictable.
    assert window["counts"]["cached"] > 0 and full["counts"]["cached"] == 0
    assert full_map[0] == window_map[0] == RESERVED
    assert frame["tables"] == frame["group_tables"][0]


def expand_id_runs(runs: list[int]) -> list[int]:
    """The block ids of `id_runs` output."""
    return [runs[i] + k for i in range(0, len(runs), 2) for k in range(runs[i + 1])]


def test_no_block_map_for_a_contiguous_manager() -> None:
    kv = BlockManager(num_blocks=4, block_size=4)
    frame = encode_replica(ReplicaSnapshot(1, None, QueueView((), (), ()), _stats(kv)))
    assert frame["map"] is None and frame["replica"] == 1 and frame["num_blocks"] == 4


def test_latency_window_and_percentiles() -> None:
    window = LatencyWindow(maxlen=3)
    for i, value in enumerate([5.0, 1.0, 2.0, 3.0]):
        window.add(value, now=float(i))
    assert window.samples(since=0.0) == [1.0, 2.0, 3.0]  # bounded: the oldest fell out
    assert window.samples(since=2.0) == [2.0, 3.0]
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0


def test_series_points_are_interval_rates_and_windowed_percentiles() -> None:
    from dataclasses import replace

    from pagoda.server.dashboard.series import SeriesRecorder
    from pagoda.server.dashboard.snapshot import LATENCY_WINDOW_S, EngineSnapshot

    stats = _stats(BlockManager(num_blocks=4, block_size=4))
    recorder = SeriesRecorder(period=1.0, maxlen=2)
    first = EngineSnapshot(100.0, (), stats, (), ())
    assert recorder.observe(first, wall=1.0) is None  # the first snapshot only starts the interval
    later_stats = replace(
        stats, generation_tokens=50, prefix_cache_queries=40, prefix_cache_hits=10, num_preemptions=2
    )
    old = 100.0 - LATENCY_WINDOW_S  # out of the window at t=102
    ttft = ((old, 9.0), (101.0, 0.1), (101.5, 0.3))
    assert recorder.observe(EngineSnapshot(100.5, (), later_stats, ttft, ()), wall=1.5) is None  # < period
    point = recorder.observe(EngineSnapshot(102.0, (), later_stats, ttft, ((101.9, 0.02),)), wall=3.0)
    assert point is not None
    assert point.output_tps == 25.0 and point.prefix_hit_rate == 0.25 and point.preemptions == 2
    assert point.ttft_p50 == 0.1 and point.ttft_p99 == 0.3  # the 9 s sample fell out of the window
    assert point.itl_p50 == point.itl_p99 == 0.02 and point.t == 3.0
    quiet = recorder.observe(EngineSnapshot(103.0, (), later_stats, (), ()), wall=4.0)
    assert quiet is not None and quiet.output_tps == 0.0 and quiet.prefix_hit_rate is None
    assert quiet.ttft_p50 is None
    assert list(recorder.points) == [point, quiet]


def test_series_points_carry_the_step_shape_and_slo_attainment_over_the_interval() -> None:
    """The budget and chunk of the latest step, and the share of the sequences finished in the interval that
    met each objective (None when none finished with one)."""
    from dataclasses import replace

    from pagoda.server.dashboard.series import SeriesRecorder
    from pagoda.server.dashboard.snapshot import EngineSnapshot

    stats = replace(
        _stats(BlockManager(num_blocks=4, block_size=4)), slo_attainment=((0, 1, 2, 2, 2),), token_budget=96
    )
    recorder = SeriesRecorder(period=1.0)
    recorder.observe(EngineSnapshot(100.0, (), stats, (), ()), wall=1.0)
    later = replace(
        stats, slo_attainment=((0, 4, 6, 2, 2), (1, 1, 2, 0, 0)), token_budget=512, chunk_size=480
    )
    point = recorder.observe(EngineSnapshot(101.0, (), later, (), ()), wall=2.0)
    assert point is not None
    assert (point.token_budget, point.chunk_size) == (512, 480)
    assert point.ttft_attainment == 4 / 6  # (3 + 1) met of (4 + 2) finished in the interval
    assert point.tpot_attainment is None  # nobody with a TPOT objective finished in it
