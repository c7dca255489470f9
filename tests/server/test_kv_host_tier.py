"""The host tier's shared-memory store (issue 39): set-associative LRU, pins, half-written slots, processes that
die holding pins, and attaching with another geometry or identity."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
from multiprocessing.synchronize import Barrier
from pathlib import Path

import pytest
from pagoda.server.kv_tiers.host import (
    WAYS,
    HostTierError,
    SharedHostStore,
    new_host_tier_path,
    pid_alive,
    remove_stale_host_tiers,
)

SLOT = 64
IDENTITY = hashlib.sha256(b"model").digest()
# Children are spawned, never forked: a fork from a pytest worker that built many engines can fail with ENOMEM
# (its large, mostly freed heap is accounted again for the child; tests/server/ray_head.py says more).
SPAWN = multiprocessing.get_context("spawn")


def key(i: int, group: int | None = None) -> bytes:
    """A digest key (with a group suffix when `group` is given)."""
    digest = hashlib.sha256(str(i).encode()).digest()
    return digest if group is None else digest + group.to_bytes(2, "little")


def store(path: Path, sets: int = 1, *, owner: bool = True) -> SharedHostStore:
    """A store of `sets` sets of WAYS slots of SLOT bytes."""
    return SharedHostStore.open(path, sets * WAYS * SLOT, SLOT, IDENTITY, owner=owner)


def put(s: SharedHostStore, k: bytes, fill: int) -> bytes | None:
    """Store `k` with every byte `fill`; the key it evicted."""
    got = s.reserve(k)
    assert got is not None
    slot, evicted = got
    s.slot(slot)[:] = bytes([fill]) * SLOT
    s.commit(slot)
    return evicted


def read(s: SharedHostStore, k: bytes) -> bytes | None:
    """The bytes of `k` (acquired and released), or None."""
    slots = s.acquire([k])
    if slots is None:
        return None
    data = bytes(s.slot(slots[0]))
    s.release(slots)
    return data


def test_round_trip_and_lru_eviction_within_a_set(tmp_path: Path) -> None:
    s = store(tmp_path / "t")
    try:
        keys = [key(i) for i in range(WAYS)]
        for i, k in enumerate(keys):
            assert put(s, k, i) is None
        assert all(s.contains(k) for k in keys)
        assert read(s, keys[0]) == bytes([0]) * SLOT  # a use: keys[0] becomes the most recent
        assert put(s, key(100), 100) == keys[1]  # the least recently used goes
        assert not s.contains(keys[1]) and s.contains(keys[0]) and s.contains(key(100))
        assert s.stats().num_used == WAYS
    finally:
        s.close()


def test_reserve_refuses_a_stored_or_pending_key(tmp_path: Path) -> None:
    s = store(tmp_path / "t")
    try:
        got = s.reserve(key(1))
        assert got is not None
        assert s.reserve(key(1)) is None  # being written
        assert not s.contains(key(1)) and s.acquire([key(1)]) is None  # never read half-written
        s.commit(got[0])
        assert s.reserve(key(1)) is None and s.contains(key(1))
    finally:
        s.close()


def test_pinned_slots_are_never_evicted(tmp_path: Path) -> None:
    s = store(tmp_path / "t")
    try:
        for i in range(WAYS):
            put(s, key(i), i)
        slots = s.acquire([key(i) for i in range(WAYS)])
        assert slots is not None
        assert s.reserve(key(99)) is None  # every way pinned
        s.release(slots[:1])
        assert put(s, key(99), 9) == key(0)
    finally:
        s.close()


def test_acquire_is_all_or_nothing(tmp_path: Path) -> None:
    s = store(tmp_path / "t")
    try:
        put(s, key(1), 1)
        assert s.acquire([key(1), key(2)]) is None
        # Nothing stayed pinned: filling the set evicts key(1) in time.
        for i in range(10, 10 + WAYS):
            put(s, key(i), 1)
        assert not s.contains(key(1))
    finally:
        s.close()


def test_group_keys_are_distinct_entries(tmp_path: Path) -> None:
    s = store(tmp_path / "t", sets=4)
    try:
        put(s, key(1), 1)
        put(s, key(1, 1), 2)
        assert read(s, key(1)) == bytes([1]) * SLOT and read(s, key(1, 1)) == bytes([2]) * SLOT
        assert not s.contains(key(1, 2))
    finally:
        s.close()


def _pin_and_die(path: str, k: bytes, write: bytes) -> None:
    """In a child process: pin `k`, reserve `write` (never committed), then die without cleaning up."""
    s = SharedHostStore.open(Path(path), WAYS * SLOT, SLOT, IDENTITY, owner=False)
    assert s.acquire([k]) is not None
    assert s.reserve(write) is not None
    os._exit(0)


def test_a_dead_processs_pins_and_half_writes_are_reclaimed(tmp_path: Path) -> None:
    path = tmp_path / "t"
    s = store(path)
    try:
        for i in range(WAYS - 1):
            put(s, key(i), i)
        child = SPAWN.Process(target=_pin_and_die, args=(str(path), key(0), key(5000)))
        child.start()
        child.join(30)
        assert child.exitcode == 0
        # The dead writer's slot is reusable at once; its pin is cleared by the next process that attaches.
        assert not s.contains(key(5000))
        other = store(path, owner=False)
        try:
            for i in range(100, 100 + WAYS):
                put(other, key(i), 7)
            assert not s.contains(key(0))  # no longer pinned: evicted like any other
        finally:
            other.close()
    finally:
        s.close()


def test_another_geometry_or_model_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t"
    s = store(path)
    try:
        with pytest.raises(HostTierError, match="another model"):
            SharedHostStore.open(path, WAYS * SLOT, SLOT, hashlib.sha256(b"other").digest(), owner=False)
        with pytest.raises(HostTierError, match="another model"):
            SharedHostStore.open(path, WAYS * SLOT, SLOT * 2, IDENTITY, owner=False)
        (tmp_path / "junk").write_bytes(b"x" * 10)
        with pytest.raises(HostTierError, match="not a host KV tier"):
            SharedHostStore.open(tmp_path / "junk", WAYS * SLOT, SLOT, IDENTITY, owner=False)
    finally:
        s.close()
    assert not path.exists()  # the owner removed it


def _writer(path: str, start: int, count: int, together: Barrier) -> None:
    """In a child process: store `count` keys from `start`, each filled with its index's low byte, starting when
    every writer has attached (`together`), so that the writes overlap."""
    s = SharedHostStore.open(Path(path), 8 * WAYS * SLOT, SLOT, IDENTITY, owner=False)
    together.wait(60)
    for i in range(start, start + count):
        got = s.reserve(key(i))
        if got is not None:
            s.slot(got[0])[:] = bytes([i % 256]) * SLOT
            s.commit(got[0])
    s.close()


def test_two_processes_writing_at_once_leave_every_slot_whole(tmp_path: Path) -> None:
    path = tmp_path / "t"
    s = store(path, sets=8)
    try:
        together = SPAWN.Barrier(2)
        procs = [SPAWN.Process(target=_writer, args=(str(path), n * 1000, 300, together)) for n in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        found = 0
        for i in [*range(300), *range(1000, 1300)]:
            data = read(s, key(i))
            if data is not None:
                found += 1
                assert data == bytes([i % 256]) * SLOT
        assert found == s.stats().num_used > 7 * WAYS  # 600 keys over 8 sets of 64: nearly every slot
    finally:
        s.close()


def test_half_full_it_loses_no_block(tmp_path: Path) -> None:
    """At half load every set has room (64 ways): a lost block would cut its prefix chain, and recomputing it
    would evict the next chain's block (16 ways lost ~0.3% of blocks and a replay kept 0.64 of its hits)."""
    s = store(tmp_path / "t", sets=16)
    try:
        keys = [key(i) for i in range(8 * WAYS)]
        for k in keys:
            assert put(s, k, 1) is None
        assert all(s.contains(k) for k in keys)
    finally:
        s.close()


def test_files_of_exited_processes_are_removed_and_no_others(tmp_path: Path) -> None:
    """`remove_stale_host_tiers`: a host tier file whose creating process has exited (a server killed with SIGKILL
    never removes its own) goes; this process's file, and files of names Pagoda does not make, stay."""
    child = SPAWN.Process(target=os._exit, args=(0,))
    child.start()
    child.join(30)
    assert child.pid is not None and not pid_alive(child.pid)
    mine = new_host_tier_path().name  # this process's pid
    dead = mine.replace(f"pagoda-kv-{os.getpid()}-", f"pagoda-kv-{child.pid}-", 1)
    names = [mine, dead, f"pagoda-kv-{child.pid}-notours", "pagoda-kv-events-x"]
    for name in names:
        (tmp_path / name).write_bytes(b"x" * 4096)
    assert remove_stale_host_tiers(tmp_path) == [tmp_path / dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for n in names if n != dead)
    assert remove_stale_host_tiers(tmp_path) == []
