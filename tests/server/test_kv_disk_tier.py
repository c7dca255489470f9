"""The KV cache's disk tier (issue #39): block files keyed by chained hash, verified on read, LRU within the size
bound, atomic writes, persistence across restarts, sharing a folder, and the start-up refusals of its flags."""

from __future__ import annotations

import errno
import hashlib
import logging
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagoda.server.kv_tiers import disk
from pagoda.server.kv_tiers.disk import (
    PATH_FLAG,
    SIZE_FLAG,
    TMP_PREFIX,
    DiskKVStore,
    DiskTierError,
    check_disk_tier,
)

IDENTITY = hashlib.sha256(b"model=tiny dtype=bfloat16 block_size=16 layout=nhd").digest()
BLOCK = 294_912  # the default model's block (what the connector hands the tier)
SMALL = 3_000  # a small block, for the many-block tests: one 4 KiB file system block with its header


def key_of(i: int, *, folder: int | None = None, group: int | None = None) -> bytes:
    """A 32-byte chain-hash-like key (its first byte forced to `folder`), + a 2-byte group index when asked."""
    digest = hashlib.sha256(i.to_bytes(8, "little")).digest()
    if folder is not None:
        digest = bytes([folder]) + digest[1:]
    return digest if group is None else digest + group.to_bytes(2, "little")


def payload_of(i: int, size: int = SMALL) -> bytes:
    """A block's bytes, different for every i."""
    return (hashlib.sha256(b"p%d" % i).digest() * (size // 32 + 1))[:size]


def block_file(root: Path, key: bytes) -> Path:
    """Where a block's file lives."""
    return root / key.hex()[:2] / (key.hex() + ".kv")


def usage(root: Path) -> tuple[int, int]:
    """(allocated, apparent) bytes of everything under root, folders included: `du -s -B1` and `du -sb`."""
    allocated = apparent = 0
    for path in [root, *root.rglob("*")]:
        st_ = path.lstat()
        allocated += st_.st_blocks * 512
        apparent += st_.st_size
    return allocated, apparent


def file_alloc(root: Path) -> int:
    """A block file's allocated size (by the tier's measure) on root's file system, for `SMALL` blocks."""
    probe = root / "probe"
    probe.mkdir()
    store = DiskKVStore(probe, 1 << 30, IDENTITY, SMALL)
    store.put(key_of(0), payload_of(0))
    store.close()
    st_ = block_file(probe, key_of(0)).stat()
    shutil.rmtree(probe)
    return max(st_.st_blocks * 512, st_.st_size)


def overhead_of(root: Path, folders: int) -> int:
    """The bytes of DIR itself and `folders` fan-out folders holding a few files (one file system block each)."""
    return (1 + folders) * max(root.stat().st_blocks * 512, root.stat().st_size)


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    """A private folder for a store."""
    path = tmp_path / "kv"
    path.mkdir(mode=0o700)
    return path


@pytest.fixture
def opened(store_dir: Path) -> Iterator[DiskKVStore]:
    """A roomy store of `SMALL` blocks, closed after the test."""
    store = DiskKVStore(store_dir, 64 << 20, IDENTITY, SMALL)
    yield store
    store.close()


# ---- round trip, restart ---------------------------------------------------------------------------------------


def test_round_trip_and_restart(store_dir: Path) -> None:
    """A block put is served (from the queue, then from disk), copied at put, and a new store on DIR serves it."""
    store = DiskKVStore(store_dir, 64 << 20, IDENTITY, BLOCK)
    buffer = bytearray(payload_of(1, BLOCK))
    view_source = bytearray(payload_of(2, BLOCK))
    long_key = key_of(3, group=5)
    assert store.put(key_of(1), buffer)
    assert store.put(key_of(2), memoryview(view_source))
    assert store.put(long_key, payload_of(3, BLOCK))
    buffer[:4] = b"XXXX"  # the caller reuses its buffers at once
    view_source[:4] = b"YYYY"
    assert store.flush(timeout=30)
    assert store.contains(key_of(1)) and store.contains(long_key) and not store.contains(key_of(9))
    assert store.get(key_of(1)) == payload_of(1, BLOCK)
    assert store.get(key_of(2)) == payload_of(2, BLOCK)
    assert store.get(key_of(9)) is None
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.num_blocks) == (2, 1, 3)
    assert stats.bytes_written == 3 * BLOCK and stats.bytes_read == 2 * BLOCK
    store.close()
    store.close()  # idempotent
    assert not store.put(key_of(4), payload_of(4, BLOCK))  # closed

    again = DiskKVStore(store_dir, 64 << 20, IDENTITY, BLOCK)
    assert again.stats().num_blocks == 3
    assert again.get(key_of(1)) == payload_of(1, BLOCK)
    assert again.get(long_key) == payload_of(3, BLOCK)
    assert again.stats().occupancy_bytes == usage(store_dir)[0]
    again.close()


def test_file_mode_and_format(opened: DiskKVStore, store_dir: Path) -> None:
    """A block file is owner-only, starts with the magic and version, and holds identity, key and payload."""
    assert opened.put(key_of(1), payload_of(1))
    opened.flush()
    path = block_file(store_dir, key_of(1))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    data = path.read_bytes()
    assert data[:6] == b"PGKV\x01\x00"
    assert data.endswith(IDENTITY + key_of(1) + payload_of(1))
    assert len(data) == 24 + len(IDENTITY) + 32 + SMALL


def test_get_serves_queued_block_and_put_refuses_duplicates(
    store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before its write a block is served from the queue; a second put of a key is dropped."""
    release = threading.Event()
    real = disk._write_all

    def held(fd: int, header: bytes, payload: bytes) -> None:
        release.wait(10)
        real(fd, header, payload)

    monkeypatch.setattr(disk, "_write_all", held)
    store = DiskKVStore(store_dir, 64 << 20, IDENTITY, SMALL)
    try:
        assert store.put(key_of(1), payload_of(1))
        assert store.contains(key_of(1))
        assert store.get(key_of(1)) == payload_of(1)
        assert not store.put(key_of(1), payload_of(1))
        release.set()
        assert store.flush(timeout=10)
        assert not store.put(key_of(1), payload_of(1))  # stored now
        assert store.stats().dropped_writes == 2
    finally:
        release.set()
        store.close()


def test_bad_arguments(opened: DiskKVStore, store_dir: Path) -> None:
    """A key of another length or type, or a payload of another size, is a caller's bug: an error, not a miss."""
    with pytest.raises(ValueError, match="32 or 34"):
        opened.get(b"short")
    with pytest.raises(TypeError):
        opened.contains("ab" * 16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="payload"):
        opened.put(key_of(1), b"x" * (SMALL + 1))
    with pytest.raises(ValueError, match="identity"):
        DiskKVStore(store_dir, 1 << 20, b"", SMALL)
    with pytest.raises(ValueError, match="> 0"):
        DiskKVStore(store_dir, 0, IDENTITY, SMALL)


# ---- bad files -------------------------------------------------------------------------------------------------


HEADER = 24 + len(IDENTITY) + 32


@pytest.mark.parametrize(
    "offset",
    [0, 4, 6, 8, 12, 20, 24, 24 + len(IDENTITY), HEADER, HEADER + SMALL // 2, HEADER + SMALL - 1],
    ids=[
        "magic",
        "version",
        "identity-len",
        "key-len",
        "length",
        "crc",
        "identity",
        "key",
        "payload0",
        "payload",
        "last",
    ],
)
def test_corrupt_byte_is_a_miss_and_deleted(opened: DiskKVStore, store_dir: Path, offset: int) -> None:
    """One flipped byte anywhere in a block file: never served, the file deleted, counted a miss."""
    assert opened.put(key_of(1), payload_of(1))
    opened.flush()
    path = block_file(store_dir, key_of(1))
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(data)
    assert opened.get(key_of(1)) is None
    assert not path.exists()
    assert not opened.contains(key_of(1))
    assert opened.stats().misses == 1 and opened.stats().num_blocks == 0


@pytest.mark.parametrize("cut", [0, 10, HEADER, HEADER + 1, HEADER + SMALL - 1])
def test_truncated_file_is_a_miss(opened: DiskKVStore, store_dir: Path, cut: int) -> None:
    """A block file cut short (a power loss after an unsynced write) is a miss and deleted; so is one too long."""
    assert opened.put(key_of(1), payload_of(1))
    opened.flush()
    path = block_file(store_dir, key_of(1))
    with open(path, "r+b") as f:
        f.truncate(cut)
    assert opened.get(key_of(1)) is None and not path.exists()
    assert opened.put(key_of(2), payload_of(2))
    opened.flush()
    with open(block_file(store_dir, key_of(2)), "ab") as f:
        f.write(b"\0")
    assert opened.get(key_of(2)) is None and not block_file(store_dir, key_of(2)).exists()


def test_foreign_identity_renamed_and_wrong_length_are_misses(store_dir: Path) -> None:
    """Another model's file, a file renamed to another key's name, and a file of another block size: misses."""
    other = DiskKVStore(store_dir, 64 << 20, hashlib.sha256(b"other model").digest(), SMALL)
    assert other.put(key_of(1), payload_of(1))
    other.close()
    store = DiskKVStore(store_dir, 64 << 20, IDENTITY, SMALL)
    assert store.contains(key_of(1))  # a name is no proof: get decides
    assert store.get(key_of(1)) is None and not block_file(store_dir, key_of(1)).exists()

    assert store.put(key_of(2), payload_of(2))
    store.flush()
    renamed = block_file(store_dir, key_of(3))
    renamed.parent.mkdir(exist_ok=True)
    os.replace(block_file(store_dir, key_of(2)), renamed)
    assert store.get(key_of(3)) is None and not renamed.exists()
    assert store.get(key_of(2)) is None  # gone: the index forgets it
    assert store.stats().num_blocks == 0
    store.close()

    bigger = DiskKVStore(store_dir, 64 << 20, IDENTITY, SMALL + 8)
    assert bigger.put(key_of(4), payload_of(4, SMALL + 8))
    bigger.close()
    store = DiskKVStore(store_dir, 64 << 20, IDENTITY, SMALL)
    assert store.get(key_of(4)) is None and not block_file(store_dir, key_of(4)).exists()
    # The same file size, another block length in the header (the checksum redone): still refused.
    head = disk._HEAD.pack(disk.MAGIC, disk.FORMAT_VERSION, len(IDENTITY), 32, 0, SMALL - 8)
    body = IDENTITY + key_of(5) + payload_of(5)
    crc = zlib.crc32(payload_of(5), zlib.crc32(IDENTITY + key_of(5), zlib.crc32(head)))
    block_file(store_dir, key_of(5)).parent.mkdir(exist_ok=True)
    block_file(store_dir, key_of(5)).write_bytes(head + disk._CRC.pack(crc) + body)
    assert store.get(key_of(5)) is None and not block_file(store_dir, key_of(5)).exists()
    assert store.stats().misses == 2
    store.close()


# ---- crashes ---------------------------------------------------------------------------------------------------


CRASHING_WRITER = """
import os, sys, time
from pathlib import Path
from pagoda.server.kv_tiers.disk import DiskKVStore
store = DiskKVStore(Path(sys.argv[1]), 1 << 30, bytes.fromhex(sys.argv[2]), int(sys.argv[3]))
os.replace = lambda *args, **kwargs: time.sleep(600)  # the write reaches its rename and the process dies there
store.put(bytes.fromhex(sys.argv[4]), b"z" * int(sys.argv[3]))
time.sleep(600)
"""


def test_killed_writer_leaves_nothing_readable_and_start_cleans_it(store_dir: Path) -> None:
    """A writer killed (SIGKILL) before its rename leaves only a temp file: no block, removed at the next start."""
    src = Path(disk.__file__).parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    args = [str(store_dir), IDENTITY.hex(), str(BLOCK), key_of(1).hex()]
    child = subprocess.Popen([sys.executable, "-c", CRASHING_WRITER, *args], env=env)
    try:
        deadline = time.monotonic() + 60
        temps: list[Path] = []
        while not temps or temps[0].stat().st_size < HEADER + BLOCK:  # the whole block is in the temp file
            assert child.poll() is None and time.monotonic() < deadline, (
                "the writer never wrote its temp file"
            )
            time.sleep(0.05)
            temps = list(store_dir.rglob(TMP_PREFIX + "*"))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert temps[0].name.startswith(f"{TMP_PREFIX}{child.pid}-")
    assert not block_file(store_dir, key_of(1)).exists()
    store = DiskKVStore(store_dir, 1 << 30, IDENTITY, BLOCK)
    assert not temps[0].exists()
    assert not store.contains(key_of(1)) and store.get(key_of(1)) is None
    assert store.stats().occupancy_bytes == usage(store_dir)[0]
    store.close()


def test_temp_files_of_live_writers_are_kept_unless_old(store_dir: Path) -> None:
    """At start a temp file whose writer lives (another replica mid-write) is kept; one older than a write
    could take, or of a dead process, is removed; get never reads temp files."""
    folder = store_dir / key_of(1).hex()[:2]
    folder.mkdir()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    live_young = folder / f"{TMP_PREFIX}1-7-1"  # pid 1 exists
    live_old = folder / f"{TMP_PREFIX}1-7-2"
    of_dead = folder / f"{TMP_PREFIX}{int(dead.stdout)}-7-3"
    for path in (live_young, live_old, of_dead):
        path.write_bytes(b"half a block")
    old = time.time_ns() - 120 * 10**9
    os.utime(live_old, ns=(old, old))
    store = DiskKVStore(store_dir, 1 << 30, IDENTITY, SMALL)
    assert live_young.exists() and not live_old.exists() and not of_dead.exists()
    assert store.stats().num_blocks == 0
    assert store.stats().occupancy_bytes == usage(store_dir)[0]  # the live temp file counts
    store.close()


# ---- size bound and LRU ----------------------------------------------------------------------------------------


def test_lru_eviction_order(store_dir: Path, tmp_path: Path) -> None:
    """With room for 3 blocks: a hit refreshes a block, the least recently used one goes first, and the order
    survives a restart (the files' mtimes)."""
    alloc = file_alloc(tmp_path)
    capacity = overhead_of(store_dir, 1) + 3 * alloc + alloc // 2
    store = DiskKVStore(store_dir, capacity, IDENTITY, SMALL)
    keys = [key_of(i, folder=7) for i in range(6)]
    for i in range(3):
        assert store.put(keys[i], payload_of(i))
        store.flush()
    assert store.get(keys[0]) == payload_of(0)  # order now 1, 2, 0
    assert store.put(keys[3], payload_of(3))
    store.flush()
    assert [store.contains(k) for k in keys[:4]] == [True, False, True, True]
    store.close()
    store = DiskKVStore(store_dir, capacity, IDENTITY, SMALL)  # order 2, 0, 3
    assert store.put(keys[4], payload_of(4))
    store.flush()
    assert [store.contains(k) for k in keys[:5]] == [True, False, False, True, True]
    assert store.stats().occupancy_bytes <= capacity
    store.close()
    # A smaller cap at the next start evicts the oldest down to it: 0 goes, 3 and 4 stay.
    store = DiskKVStore(store_dir, capacity - alloc, IDENTITY, SMALL)
    assert [store.contains(k) for k in keys[:5]] == [False, False, False, True, True]
    store.close()


def test_burst_of_writes_keeps_its_order_across_a_restart(store_dir: Path, tmp_path: Path) -> None:
    """Blocks written within one tick of the kernel's coarse file clock still restart in write order: the
    tier stamps each file's mtime itself (a strictly increasing ns clock), so the oldest go first."""
    alloc = file_alloc(tmp_path)
    keys = sorted((key_of(i, folder=5) for i in range(8)), reverse=True)  # ties would fall back to key order
    store = DiskKVStore(store_dir, 64 << 20, IDENTITY, SMALL)
    for i, key in enumerate(keys):
        assert store.put(key, payload_of(i))
    store.close()
    mtimes = [block_file(store_dir, key).stat().st_mtime_ns for key in keys]
    assert mtimes == sorted(set(mtimes))
    store = DiskKVStore(store_dir, overhead_of(store_dir, 1) + 4 * alloc + alloc // 2, IDENTITY, SMALL)
    assert [store.contains(key) for key in keys] == [False] * 4 + [True] * 4
    store.close()


def test_writes_and_hits_share_one_clock(
    store_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write after a hit is the more recent after a restart even when the kernel's file clock lags the
    process's (here by an hour; in practice by up to a tick): writes are stamped like hits."""
    alloc = file_alloc(tmp_path)
    monkeypatch.setattr(disk, "_now_ns", lambda: time.time_ns() + 3600 * 10**9)
    store = DiskKVStore(store_dir, 64 << 20, IDENTITY, SMALL)
    first, second = key_of(1, folder=4), key_of(2, folder=4)
    assert store.put(first, payload_of(1))
    store.flush()
    assert store.get(first) == payload_of(1)
    assert store.put(second, payload_of(2))
    store.close()
    store = DiskKVStore(store_dir, overhead_of(store_dir, 1) + alloc + alloc // 2, IDENTITY, SMALL)
    assert not store.contains(first) and store.contains(second)
    store.close()


def test_size_bound_counts_everything_under_dir(store_dir: Path) -> None:
    """Many real-size blocks into a 4 MiB tier (fan-out folders, a stray file): `du` of DIR stays under the cap
    within 5% and the tier fills it (it evicts no more than needed); its occupancy is du's number."""
    capacity = 4 << 20
    (store_dir / "README").write_bytes(b"x" * 10_000)  # not ours: counted, kept
    store = DiskKVStore(store_dir, capacity, IDENTITY, BLOCK, rescan_bytes=3 * BLOCK)
    for i in range(60):
        store.put(key_of(i), payload_of(i, BLOCK))
        if i % 7 == 0:
            store.flush()
    store.flush()
    allocated, apparent = usage(store_dir)
    stats = store.stats()
    assert allocated <= capacity * 1.05 and apparent <= capacity * 1.05
    block_alloc = (HEADER + BLOCK + 4095) // 4096 * 4096
    assert allocated >= capacity - 2 * block_alloc  # full but for less than two blocks
    assert stats.occupancy_bytes == allocated
    assert stats.num_blocks == len(list(store_dir.rglob("*.kv"))) >= 10
    assert (store_dir / "README").exists()
    if shutil.which("du"):
        du_b = subprocess.run(["du", "-sb", str(store_dir)], capture_output=True, text=True, check=True)
        du_alloc = subprocess.run(
            ["du", "-s", "-B1", str(store_dir)], capture_output=True, text=True, check=True
        )
        assert int(du_b.stdout.split()[0]) <= capacity * 1.05
        assert int(du_alloc.stdout.split()[0]) <= capacity * 1.05
    # The most recent blocks are the ones kept.
    assert all(store.contains(key_of(i)) for i in range(60 - stats.num_blocks, 60))
    store.close()


def test_block_larger_than_capacity_is_dropped(store_dir: Path) -> None:
    """A tier too small for one block takes none (and evicts nothing for it)."""
    store = DiskKVStore(store_dir, 100_000, IDENTITY, BLOCK)
    assert store.put(key_of(1), payload_of(1, BLOCK))
    store.flush()
    assert not store.contains(key_of(1)) and store.stats().dropped_writes == 1
    store.close()


# ---- disk full, queue, flush, close ----------------------------------------------------------------------------


def test_disk_full_disables_writes_and_reads_go_on(
    opened: DiskKVStore, store_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """ENOSPC while serving: one warning, the tier disabled (puts refused), no temp file left, reads served."""
    assert opened.put(key_of(1), payload_of(1))
    opened.flush()

    def full(fd: int, header: bytes, payload: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(disk, "_write_all", full)
    with caplog.at_level(logging.WARNING, logger=disk.__name__):
        assert opened.put(key_of(2), payload_of(2))
        assert opened.put(key_of(3), payload_of(3))  # queued before the failure was seen, or refused
        opened.flush()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "full" in warnings[0].getMessage()
    stats = opened.stats()
    assert stats.disabled and stats.dropped_writes == 2 and stats.num_blocks == 1
    assert not opened.put(key_of(4), payload_of(4))
    assert not list(store_dir.rglob(TMP_PREFIX + "*"))
    assert not opened.contains(key_of(2))
    assert opened.get(key_of(1)) == payload_of(1)


def test_queue_full_flush_timeout_and_close_drains(store_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full queue drops puts; flush times out while writes are held; close writes everything queued."""
    release = threading.Event()
    real = disk._write_all

    def held(fd: int, header: bytes, payload: bytes) -> None:
        release.wait(10)
        real(fd, header, payload)

    monkeypatch.setattr(disk, "_write_all", held)
    store = DiskKVStore(store_dir, 64 << 20, IDENTITY, SMALL, max_queued_writes=4)
    accepted = [store.put(key_of(i), payload_of(i)) for i in range(8)]
    # One may have left the queue for the (held) writer before the rest came.
    assert accepted[:4] == [True] * 4 and accepted.count(True) in (4, 5)
    assert store.stats().dropped_writes == 8 - accepted.count(True)
    assert not store.flush(timeout=0.05)
    release.set()
    store.close()
    assert all(block_file(store_dir, key_of(i)).exists() == accepted[i] for i in range(8))
    again = DiskKVStore(store_dir, 64 << 20, IDENTITY, SMALL)
    assert all((again.get(key_of(i)) == payload_of(i)) == accepted[i] for i in range(8))
    again.close()


# ---- several processes on one DIR ------------------------------------------------------------------------------


def test_two_stores_share_a_folder(store_dir: Path, tmp_path: Path) -> None:
    """One replica's write is the other's hit; an eviction by one is a plain miss for the other; rescans keep
    the folder under the cap both share."""
    alloc = file_alloc(tmp_path)
    capacity = overhead_of(store_dir, 1) + 6 * alloc + alloc // 2
    a = DiskKVStore(store_dir, capacity, IDENTITY, SMALL, rescan_bytes=1)
    b = DiskKVStore(store_dir, capacity, IDENTITY, SMALL, rescan_bytes=1)
    assert a.put(key_of(1, folder=9), payload_of(1))
    a.flush()
    assert b.contains(key_of(1, folder=9))
    assert b.get(key_of(1, folder=9)) == payload_of(1)
    assert b.stats().hits == 1 and b.stats().num_blocks == 1
    assert b.put(key_of(2, folder=9), payload_of(2))
    b.flush()
    assert a.get(key_of(2, folder=9)) == payload_of(2)
    for i in range(3, 9):  # a writes 3..5, b 6..8: 8 blocks into room for 6
        (a if i < 6 else b).put(key_of(i, folder=9), payload_of(i))
        (a if i < 6 else b).flush()
    assert usage(store_dir)[0] <= capacity
    kept = [i for i in range(1, 9) if block_file(store_dir, key_of(i, folder=9)).exists()]
    assert len(kept) == 6 and kept[-3:] == [6, 7, 8]
    # a's next write relists the folder: what b evicted leaves a's books, what b wrote enters them.
    assert a.put(key_of(9, folder=9), payload_of(9))
    a.flush()
    files = sorted(store_dir.rglob("*.kv"))
    assert a.stats().num_blocks == len(files) == 6
    assert a.stats().occupancy_bytes == usage(store_dir)[0] <= capacity
    kept = [i for i in range(1, 10) if block_file(store_dir, key_of(i, folder=9)).exists()]
    assert kept[-4:] == [6, 7, 8, 9]
    for i in range(1, 10):  # whatever the other evicted is a miss, never an error
        assert b.get(key_of(i, folder=9)) == (payload_of(i) if i in kept else None)
    a.close()
    b.close()


def test_a_removed_folder_is_made_again(opened: DiskKVStore, store_dir: Path) -> None:
    """A fan-out folder removed under the store (an operator's rm, another replica) is recreated by the next
    write there, and the blocks that were in it are misses."""
    assert opened.put(key_of(1, folder=6), payload_of(1))
    opened.flush()
    shutil.rmtree(store_dir / "06")
    assert opened.get(key_of(1, folder=6)) is None
    assert opened.put(key_of(2, folder=6), payload_of(2))
    opened.flush()
    assert opened.get(key_of(2, folder=6)) == payload_of(2)
    assert opened.stats().dropped_writes == 0 and opened.stats().num_blocks == 1


def test_rescan_forgets_files_removed_by_another_process(store_dir: Path) -> None:
    """Files another replica evicted leave this store's books at its next relisting (not only when it would
    evict them itself), so it does not under-fill the tier."""
    store = DiskKVStore(store_dir, 64 << 20, IDENTITY, SMALL, rescan_bytes=1)
    for i in range(4):
        assert store.put(key_of(i, folder=8), payload_of(i))
    store.flush()
    for i in (1, 2):  # another replica's eviction
        block_file(store_dir, key_of(i, folder=8)).unlink()
    assert store.put(key_of(4, folder=8), payload_of(4))
    store.flush()
    assert store.stats().num_blocks == 3
    assert store.stats().occupancy_bytes == usage(store_dir)[0]
    store.close()


def test_occupancy_is_du_without_rescans(store_dir: Path) -> None:
    """The books match `du` write by write, new fan-out folders included, with no relisting to correct them."""
    store = DiskKVStore(store_dir, 64 << 20, IDENTITY, SMALL, rescan_bytes=1 << 50)
    for i in range(12):
        assert store.put(key_of(i), payload_of(i))
        store.flush()
        assert store.stats().occupancy_bytes == usage(store_dir)[0]
    store.close()


def test_names_that_are_not_blocks_are_counted_and_kept(store_dir: Path) -> None:
    """Upper-case hex, a block name in the wrong folder, another length, a folder inside a fan-out folder:
    not blocks (never served or deleted), but their bytes count against the cap."""
    key = key_of(1, folder=0xAB)
    (store_dir / "ab").mkdir()
    (store_dir / "cd").mkdir()
    strays = [
        store_dir / "ab" / (key.hex()[:2] + key.hex()[2:].upper() + ".kv"),
        store_dir / "cd" / (key.hex() + ".kv"),
        store_dir / "ab" / (key.hex()[:-2] + ".kv"),
        store_dir / "ab" / (key.hex() + ".bak"),
    ]
    for path in strays:
        path.write_bytes(b"x" * 5000)
    (store_dir / "ab" / "sub").mkdir()
    (store_dir / "ab" / "sub" / "f").write_bytes(b"y" * 9000)
    store = DiskKVStore(store_dir, 64 << 20, IDENTITY, SMALL)
    assert store.stats().num_blocks == 0 and not store.contains(key)
    assert store.stats().occupancy_bytes == usage(store_dir)[0]
    assert store.get(key) is None
    assert all(path.exists() for path in strays)
    store.close()


# ---- check_disk_tier -------------------------------------------------------------------------------------------


def test_check_creates_a_private_folder(tmp_path: Path) -> None:
    """A missing DIR is made (parents too) with mode 0700 whatever the umask; a symlink resolves."""
    old = os.umask(0o277)  # a umask that would leave the folder unwritable: the mode is set, not masked
    try:
        made = check_disk_tier(str(tmp_path / "leaf"), 1.0)
    finally:
        os.umask(old)
    assert made == (tmp_path / "leaf").resolve()
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    nested = check_disk_tier(str(tmp_path / "a" / "b" / "kv"), 0.5)
    assert stat.S_IMODE(nested.stat().st_mode) == 0o700
    (tmp_path / "link").symlink_to(nested)
    assert check_disk_tier(str(tmp_path / "link"), 0.5) == nested
    assert not list(nested.iterdir())  # the writability probe left nothing


def test_check_refuses_a_file_and_a_path_under_a_file(tmp_path: Path) -> None:
    """A path that is a file, or needs a folder inside a file: refused naming the path flag."""
    (tmp_path / "f").write_text("x")
    for path in (tmp_path / "f", tmp_path / "f" / "kv"):
        with pytest.raises(DiskTierError, match=PATH_FLAG):
            check_disk_tier(str(path), 1.0)
    with pytest.raises(DiskTierError, match=PATH_FLAG):
        check_disk_tier("", 1.0)


def test_check_refuses_an_unwritable_folder(tmp_path: Path) -> None:
    """A 0555 folder is refused by the explicit mode check (which holds for root too, whom os.access lets by)."""
    path = tmp_path / "ro"
    path.mkdir()
    path.chmod(0o555)
    try:
        with pytest.raises(DiskTierError, match=f"{PATH_FLAG}.*not writable"):
            check_disk_tier(str(path), 1.0)
    finally:
        path.chmod(0o700)


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_check_refuses_a_folder_others_can_write(tmp_path: Path, mode: int) -> None:
    """A group- or other-writable folder: anyone could plant blocks; refused naming the path flag."""
    path = tmp_path / "open"
    path.mkdir()
    path.chmod(mode)
    with pytest.raises(DiskTierError, match=f"{PATH_FLAG}.*writable by others"):
        check_disk_tier(str(path), 1.0)


def test_check_refuses_a_folder_of_another_user(tmp_path: Path) -> None:
    """A folder owned by someone else (uid 65534) is refused naming the path flag."""
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root; as a user the refusal is the same st_uid check")
    path = tmp_path / "theirs"
    path.mkdir(mode=0o700)
    os.chown(path, 65534, 65534)
    with pytest.raises(DiskTierError, match=f"{PATH_FLAG}.*owned by uid 65534"):
        check_disk_tier(str(path), 1.0)


def test_check_refuses_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder where no block can be written (the disk full) is refused naming the path flag."""

    def full(fd: int, header: bytes, payload: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(disk, "_write_all", full)
    with pytest.raises(DiskTierError, match=f"{PATH_FLAG}.*No space left"):
        check_disk_tier(str(tmp_path / "kv"), 1.0)
    assert not list((tmp_path / "kv").iterdir())


@pytest.mark.parametrize("size", [0.0, -1.0, math.nan, math.inf, -math.inf, True])
def test_check_refuses_bad_sizes(tmp_path: Path, size: float) -> None:
    """A size <= 0, NaN or infinite is refused naming the size flag."""
    with pytest.raises(DiskTierError, match=SIZE_FLAG):
        check_disk_tier(str(tmp_path / "kv"), size)


def test_check_refuses_an_absurd_size_counting_what_dir_holds(tmp_path: Path) -> None:
    """More than the file system's free space plus DIR's own contents is refused, naming both flags; what DIR
    already holds (a restart's blocks) counts as room."""
    path = check_disk_tier(str(tmp_path / "kv"), 0.001)
    vfs = os.statvfs(path)
    free_gib = vfs.f_bavail * vfs.f_frsize / 2**30
    with pytest.raises(DiskTierError, match=f"{SIZE_FLAG}.*{PATH_FLAG}"):
        check_disk_tier(str(path), free_gib * 2 + 1)
    with pytest.raises(DiskTierError, match=SIZE_FLAG):
        check_disk_tier(str(path), 1e12)
    # A block file of 8 MiB in DIR: asking for free + 4 MiB is fine (the file is reused room), + 16 MiB is not.
    (path / "held").write_bytes(os.urandom(8 << 20))
    vfs = os.statvfs(path)
    free = vfs.f_bavail * vfs.f_frsize
    assert check_disk_tier(str(path), (free + (4 << 20)) / 2**30) == path
    with pytest.raises(DiskTierError, match=SIZE_FLAG):
        check_disk_tier(str(path), (free + (16 << 20)) / 2**30)


# ---- property: random sequences against a model ----------------------------------------------------------------


@st.composite
def operations(draw: st.DrawFn) -> list[tuple[str, int]]:
    """A sequence of (put | get | restart, key number) over a few keys."""
    return draw(
        st.lists(
            st.tuples(st.sampled_from(["put", "put", "get", "get", "restart"]), st.integers(0, 7)),
            max_size=30,
        )
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations(), room=st.integers(1, 4))
def test_matches_an_lru_model(ops: list[tuple[str, int]], room: int) -> None:
    """Random puts, gets and restarts against an LRU dict of `room` blocks: the same answers, the same files on
    disk, and the folder never over the cap."""
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        alloc = file_alloc(root)
        path = root / "kv"
        path.mkdir(mode=0o700)
        capacity = overhead_of(path, 1) + room * alloc + alloc // 2
        store = DiskKVStore(path, capacity, IDENTITY, SMALL)
        model: OrderedDict[int, bytes] = OrderedDict()
        try:
            for op, i in ops:
                key = key_of(i, folder=3)
                if op == "put":
                    assert store.put(key, payload_of(i)) == (i not in model)
                    store.flush()
                    if i not in model:
                        model[i] = payload_of(i)
                        while len(model) > room:
                            model.popitem(last=False)
                elif op == "get":
                    assert store.get(key) == model.get(i)
                    if i in model:
                        model.move_to_end(i)
                else:
                    store.close()
                    store = DiskKVStore(path, capacity, IDENTITY, SMALL)
                on_disk = {i for i in range(8) if block_file(path, key_of(i, folder=3)).exists()}
                assert on_disk == set(model)
                assert usage(path)[0] <= capacity
                assert store.stats().occupancy_bytes == usage(path)[0]
                assert sum(map(len, store._folder_keys.values())) == store.stats().num_blocks
        finally:
            store.close()
