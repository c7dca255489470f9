"""The host tier's store: KV blocks in one shared-memory file, shared by every engine core (replica) on the host.

The file is a set-associative cache, as a CPU cache is: a block's key picks its set (the key is a sha256
digest, so sets fill evenly), and the set's `WAYS` slots are searched (by an 8-byte tag per slot, found with one
C-speed search of the set's tags) and evicted least-recently-used first. 64 ways keep a set from overflowing
while the tier is not full (16 ways lost ~0.3% of the blocks at half load: each loss cuts a prefix chain, and
recomputing it evicted the next chain's block, a cascade that left 0.64 of a replayed trace's hits). No
index lives outside the file, so a block one replica saved is a hit for every other, and the file outlives an
engine core's restart (the server, which chose its name, removes it at exit).

Layout: a 4 KiB header (magic, geometry, the KV identity, the LRU clock, the count of stored blocks, the table of
attached processes), then 64 bytes of metadata per slot (key, state, last use, pin mask, writer pid), 8 bytes of
tag per slot (zero when empty), then the slots' bytes. Every
mutation holds `flock` on the file (between processes) and a thread lock (between threads of one process:
flock does not exclude them). A slot is pinned by a bit per attached process while a load copies it, and a
process that died leaves its bits and half-written slots to the next process that attaches.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import struct
import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

MAGIC = b"PGKVHOST"
VERSION = 3  # 2: the header counts the stored blocks; 3: 64 ways found by tags
WAYS = 64
TAG_BYTES = 8
_EMPTY_TAG = bytes(TAG_BYTES)
HEADER_BYTES = 4096
META_BYTES = 64
MAX_PROCS = 64
_HEADER = struct.Struct("<8sIIQQ32s")  # magic, version, ways, num_sets, slot_bytes, identity
_CLOCK_AT = 256  # u64: the LRU clock
_USED_AT = 264  # u64: slots in state VALID (kept under the lock: occupancy without a scan)
_PROCS_AT = 512  # MAX_PROCS x u64: pids of attached processes (0: free)
_META = struct.Struct("<34sBB4xQQQ")  # key, key length, state, last use, pin mask, writer pid
EMPTY, WRITING, VALID = 0, 1, 2


class HostTierError(ValueError):
    """The shared-memory file cannot serve as this engine's host tier (another geometry or model)."""


@dataclass(frozen=True, slots=True)
class HostTierStats:
    """The host tier's occupancy, read from the shared file (every replica's blocks)."""

    num_slots: int
    num_used: int
    slot_bytes: int


def default_shm_dir() -> Path:
    """Where shared-memory files live: /dev/shm on Linux (memory, not disk), else the temp folder."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


# A host tier file Pagoda names itself: its creator's pid, then a random suffix.
_TIER_FILE = re.compile(r"pagoda-kv-(\d+)-[0-9a-f]{12}")


def new_host_tier_path() -> Path:
    """A fresh name for a host tier file this process owns (in `default_shm_dir`), after removing those of
    processes that have exited (`remove_stale_host_tiers`)."""
    remove_stale_host_tiers()
    return default_shm_dir() / f"pagoda-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def remove_stale_host_tiers(folder: Path | None = None) -> list[Path]:
    """Remove this user's host tier files (in `folder`, default `default_shm_dir`) whose creating process is gone:
    a server killed with SIGKILL never removes its file, and on /dev/shm the blocks it held stay in memory until
    reboot. A file whose pid is alive (or reused) is kept. The removed paths."""
    folder = default_shm_dir() if folder is None else folder
    removed: list[Path] = []
    for path in folder.glob("pagoda-kv-*"):
        match = _TIER_FILE.fullmatch(path.name)
        try:
            if match is None or pid_alive(int(match.group(1))):
                continue
            st = path.stat()
            if st.st_uid != os.getuid():
                continue
            path.unlink()
        except OSError:  # gone meanwhile, or not ours to remove
            continue
        removed.append(path)
        logger.info(
            "removed %s, the host KV tier of a process that has exited (%.1f MiB held)",
            path,
            st.st_blocks / 2048,
        )
    return removed


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SharedHostStore:
    """Fixed-size block slots in a shared-memory file, found by key; create or attach with `open`."""

    def __init__(self, fd: int, path: Path, num_sets: int, slot_bytes: int, *, owner: bool) -> None:
        """Map an initialised file (use `open`)."""
        self.path = path
        self.num_sets = num_sets
        self.num_slots = num_sets * WAYS
        self.slot_bytes = slot_bytes
        self.owner = owner  # removes the file at close
        self._fd = fd
        self._size = os.fstat(fd).st_size
        self._map = mmap.mmap(fd, self._size)
        self._buf = memoryview(self._map)
        self._tags_at = HEADER_BYTES + META_BYTES * self.num_slots
        self._data_at = _data_offset(self.num_slots)
        self._thread_lock = threading.Lock()
        self._proc_index: int | None = None
        self._closed = False
        self._attach()

    @classmethod
    def open(
        cls, path: Path, capacity_bytes: int, slot_bytes: int, identity: bytes, *, owner: bool
    ) -> SharedHostStore:
        """Create the file for `capacity_bytes` of slots, or attach to the one another process made (its geometry
        and identity must match: HostTierError otherwise); an `owner` removes the file at close (the server, or
        an engine that made a private tier)."""
        if len(identity) != 32:
            raise ValueError("identity must be a 32-byte digest")
        num_sets = max(1, capacity_bytes // (slot_bytes * WAYS))
        size = _data_offset(num_sets * WAYS) + num_sets * WAYS * slot_bytes
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            fd = os.open(path, os.O_RDWR)
            try:
                return cls._attach_existing(fd, path, slot_bytes, identity, owner)
            except BaseException:
                os.close(fd)
                raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.ftruncate(fd, size)  # a sparse file: pages become memory as slots are written
            with mmap.mmap(fd, HEADER_BYTES) as head:
                _HEADER.pack_into(head, 0, MAGIC, VERSION, WAYS, num_sets, slot_bytes, identity)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return cls(fd, path, num_sets, slot_bytes, owner=owner)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise

    @classmethod
    def _attach_existing(
        cls, fd: int, path: Path, slot_bytes: int, identity: bytes, owner: bool
    ) -> SharedHostStore:
        """Attach to a file another process created (waiting for its header under the lock)."""
        fcntl.flock(fd, fcntl.LOCK_EX)  # the creator holds it until the header is written
        try:
            if os.fstat(fd).st_size < HEADER_BYTES:
                raise HostTierError(f"{path} is not a host KV tier (too short)")
            head = os.pread(fd, _HEADER.size, 0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        magic, version, ways, num_sets, their_slot, their_identity = _HEADER.unpack(head)
        if magic != MAGIC or version != VERSION or ways != WAYS:
            raise HostTierError(f"{path} is not a version-{VERSION} host KV tier")
        if their_slot != slot_bytes or their_identity != identity:
            raise HostTierError(f"{path} holds another model's or layout's KV blocks")
        return cls(fd, path, num_sets, slot_bytes, owner=owner)

    # ------------------------------------------------------------------ locking

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Exclusive access to the metadata, across threads and processes."""
        with self._thread_lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _attach(self) -> None:
        """Take a row of the process table; clear what dead processes left (pins, half-written slots)."""
        me = os.getpid()
        with self._locked():
            dead_bits = 0
            free: int | None = None
            for i in range(MAX_PROCS):
                (pid,) = struct.unpack_from("<Q", self._buf, _PROCS_AT + 8 * i)
                if pid and pid != me and not pid_alive(pid):
                    dead_bits |= 1 << i
                    struct.pack_into("<Q", self._buf, _PROCS_AT + 8 * i, 0)
                    pid = 0
                if free is None and pid in (0, me):
                    free = i
            if free is None:
                raise HostTierError(f"more than {MAX_PROCS} processes share {self.path}")
            struct.pack_into("<Q", self._buf, _PROCS_AT + 8 * free, me)
            self._proc_index = free
            # A new process in a dead one's row: that row's old pins must not keep slots forever.
            stale = dead_bits | (1 << free)
            used = 0
            for slot in range(self.num_slots):
                key, n, state, tick, pins, writer = self._meta(slot)
                used += state == VALID
                if pins & stale or (state == WRITING and not pid_alive(writer)):
                    new_state = EMPTY if state == WRITING else state
                    self._set_meta(slot, key[:n], new_state, tick, pins & ~stale, 0)
            # The scan also recounts the stored blocks (a process killed mid-update cannot skew them for long).
            struct.pack_into("<Q", self._buf, _USED_AT, used)

    # ----------------------------------------------------------------- metadata

    def _meta(self, slot: int) -> tuple[bytes, int, int, int, int, int]:
        """(key padded to 34 bytes, key length, state, last use, pin mask, writer pid) of `slot`."""
        key, n, state, tick, pins, writer = _META.unpack_from(self._buf, HEADER_BYTES + META_BYTES * slot)
        return key, n, state, tick, pins, writer

    def _set_meta(self, slot: int, key: bytes, state: int, tick: int, pins: int, writer: int) -> None:
        """Write `slot`'s metadata and tag (under the lock)."""
        _META.pack_into(self._buf, HEADER_BYTES + META_BYTES * slot, key, len(key), state, tick, pins, writer)
        at = self._tags_at + TAG_BYTES * slot
        self._buf[at : at + TAG_BYTES] = _tag(key) if state != EMPTY else bytes(TAG_BYTES)

    def _tick(self) -> int:
        """The next value of the shared LRU clock (under the lock)."""
        clock = int(struct.unpack_from("<Q", self._buf, _CLOCK_AT)[0]) + 1
        struct.pack_into("<Q", self._buf, _CLOCK_AT, clock)
        return clock

    def _used(self) -> int:
        """The count of VALID slots in the header."""
        return int(struct.unpack_from("<Q", self._buf, _USED_AT)[0])

    def _add_used(self, delta: int) -> None:
        """Move the count of VALID slots (under the lock)."""
        struct.pack_into("<Q", self._buf, _USED_AT, max(0, self._used() + delta))

    def _set_of(self, key: bytes) -> range:
        """The slots of `key`'s set."""
        first = int.from_bytes(_tag(key), "little") % self.num_sets * WAYS
        return range(first, first + WAYS)

    def _find(self, key: bytes, states: tuple[int, ...] = (VALID,)) -> int | None:
        """The slot holding `key` in one of `states`, or None."""
        ways = self._set_of(key)
        start = self._tags_at + TAG_BYTES * ways.start
        tags = self._buf[start : start + TAG_BYTES * WAYS].tobytes()
        tag = _tag(key)
        at = tags.find(tag)
        while at >= 0:
            if at % TAG_BYTES == 0:
                slot = ways.start + at // TAG_BYTES
                k, n, state, _, _, _ = self._meta(slot)
                if state in states and n == len(key) and k[:n] == key:
                    return slot
            at = tags.find(tag, at + 1)
        return None

    # ------------------------------------------------------------------ queries

    def contains(self, key: bytes) -> bool:
        """Whether a whole block of `key` is stored (without the lock: a hint; `acquire` decides)."""
        return self._find(key) is not None

    def stats(self) -> HostTierStats:
        """Slots and how many hold a block: the header's count (O(1), read without the lock: a metric)."""
        return HostTierStats(self.num_slots, self._used(), self.slot_bytes)

    def scan_used(self) -> int:
        """Slots holding a block, counted from the metadata (O(slots): a check of `stats`, not for metrics)."""
        return sum(1 for slot in range(self.num_slots) if self._meta(slot)[2] == VALID)

    @property
    def data(self) -> mmap.mmap:
        """The mapping (the slots start at `data_offset`): for a tensor view of every slot."""
        return self._map

    @property
    def data_offset(self) -> int:
        """Where slot 0's bytes start in `data`."""
        return self._data_at

    def slot(self, slot: int) -> memoryview:
        """The bytes of `slot` (the caller pinned or reserved it)."""
        start = self._data_at + slot * self.slot_bytes
        return self._buf[start : start + self.slot_bytes]

    def read(self, key: bytes) -> bytes | None:
        """A copy of `key`'s block (a use: LRU refreshed), or None when it is not stored. Copied under the lock,
        with no pin: a stored slot changes only once a writer evicts it, and choosing a victim takes the lock
        (a pin is a bit per process, so another thread of this process must not set and clear it)."""
        with self._locked():
            slot = self._find(key)
            if slot is None:
                return None
            stored, n, state, _, pins, writer = self._meta(slot)
            self._set_meta(slot, stored[:n], state, self._tick(), pins, writer)
            return bytes(self.slot(slot))

    # ---------------------------------------------------------------- mutations

    def acquire(self, keys: Sequence[bytes]) -> list[int] | None:
        """Pin the slots of `keys` for this process (a use: LRU refreshed); None, pinning none, if one is missing."""
        assert self._proc_index is not None
        bit = 1 << self._proc_index
        with self._locked():
            slots = [self._find(key) for key in keys]
            if any(s is None for s in slots):
                return None
            for slot in slots:
                assert slot is not None
                key, n, state, _, pins, writer = self._meta(slot)
                self._set_meta(slot, key[:n], state, self._tick(), pins | bit, writer)
        return [s for s in slots if s is not None]

    def release(self, slots: Sequence[int]) -> None:
        """Unpin slots this process acquired."""
        assert self._proc_index is not None
        bit = 1 << self._proc_index
        with self._locked():
            for slot in slots:
                key, n, state, tick, pins, writer = self._meta(slot)
                self._set_meta(slot, key[:n], state, tick, pins & ~bit, writer)

    def reserve(self, key: bytes) -> tuple[int, bytes | None] | None:
        """A slot to write `key` into, and the key it evicted (None: it was empty); None when `key` is stored or
        being written already, or every slot of its set is pinned or being written."""
        return self.reserve_many([key])[0]

    def reserve_many(self, keys: Sequence[bytes]) -> list[tuple[int, bytes | None] | None]:
        """`reserve` for each key, under one lock."""
        me = os.getpid()
        out: list[tuple[int, bytes | None] | None] = []
        with self._locked():
            for key in keys:
                if self._find(key, (VALID, WRITING)) is not None:
                    out.append(None)
                    continue
                victim = self._victim(key)
                if victim is None:
                    out.append(None)
                    continue
                old, n, state, _, _, _ = self._meta(victim)
                self._set_meta(victim, key, WRITING, self._tick(), 0, me)
                if state == VALID:
                    self._add_used(-1)
                out.append((victim, old[:n] if state == VALID else None))
        return out

    def _victim(self, key: bytes) -> int | None:
        """An empty slot of `key`'s set (found by its zero tag), else its least recently used evictable one."""
        ways = self._set_of(key)
        start = self._tags_at + TAG_BYTES * ways.start
        tags = self._buf[start : start + TAG_BYTES * WAYS].tobytes()
        at = tags.find(_EMPTY_TAG)
        while at >= 0:
            if at % TAG_BYTES == 0 and self._meta(ways.start + at // TAG_BYTES)[2] == EMPTY:
                return ways.start + at // TAG_BYTES
            at = tags.find(_EMPTY_TAG, at + 1)
        victim: int | None = None
        victim_tick = 0
        for slot in ways:
            _, _, state, tick, pins, writer = self._meta(slot)
            evictable = (state == VALID and not pins) or (state == WRITING and not pid_alive(writer))
            if evictable and (victim is None or tick < victim_tick):
                victim, victim_tick = slot, tick
        return victim

    def commit(self, slot: int) -> None:
        """`slot`'s bytes are written: it becomes a hit."""
        self.commit_many([slot])

    def commit_many(self, slots: Sequence[int]) -> None:
        """`commit` for each slot, under one lock."""
        with self._locked():
            for slot in slots:
                key, n, state, _, pins, _ = self._meta(slot)
                self._set_meta(slot, key[:n], VALID, self._tick(), pins, 0)
                if state != VALID:
                    self._add_used(1)

    def abandon(self, slot: int) -> None:
        """A reserved slot was not written: empty it."""
        with self._locked():
            if self._meta(slot)[2] == VALID:
                self._add_used(-1)
            self._set_meta(slot, b"", EMPTY, 0, 0, 0)

    def close(self) -> None:
        """Leave the process table and unmap; the owner also removes the file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._proc_index is not None:
            with self._locked():
                struct.pack_into("<Q", self._buf, _PROCS_AT + 8 * self._proc_index, 0)
        self._buf.release()
        # A tensor may still view the slots: the mapping then goes with the last view.
        with contextlib.suppress(BufferError):
            self._map.close()
        os.close(self._fd)
        if self.owner:
            self.path.unlink(missing_ok=True)


def _tag(key: bytes) -> bytes:
    """A key's 8-byte tag: its digest's first bytes, mixed with a group suffix so groups spread over sets."""
    head = key[:TAG_BYTES]
    if len(key) <= 32:
        return head
    return (
        int.from_bytes(head, "little") ^ (int.from_bytes(key[32:], "little") * 0x9E3779B97F4A7C15)
    ).to_bytes(16, "little")[:TAG_BYTES]


def _data_offset(num_slots: int) -> int:
    """Where the slots' bytes start: after the header, the metadata and the tags, page-aligned."""
    meta_end = HEADER_BYTES + (META_BYTES + TAG_BYTES) * num_slots
    return -(-meta_end // mmap.PAGESIZE) * mmap.PAGESIZE
