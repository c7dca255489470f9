"""The disk tier of the KV cache (issue #39): prefix-cache blocks as files under `--kv-offloading-disk-path`.

A block is one file, `DIR/<first key byte, hex>/<key hex>.kv`, named by its key (the block's chained hash, which
includes the cache salt; bytes in, bytes out: no torch here). The files are the index: nothing else is kept, so
a restart rescans DIR and serves what it holds. Layout of a file (little-endian):

    b"PGKV"  u16 version  u16 identity length  u16 key length  u16 reserved (0)  u64 payload length
    u32 crc32 of everything else in the file (the 20 bytes above, identity, key, payload)
    identity  key  payload

A read checks every field against what it asked for (the identity: the model / dtype / block size / layout
digest the caller computed), the file's length and the checksum; any mismatch is a miss and the file is deleted.
Writes go to `.tmp-<pid>-...` in the same folder and are renamed over the final name (os.replace) only once
whole, so a crash leaves a temp file (removed at the next start, never read) and never a half block under a
block's name. Occupancy counts every file and folder under DIR at its allocated size (max of st_blocks * 512 and
st_size, so `du -sb` and `du -s` both stay under the cap); the least recently used blocks are evicted before a
write would pass the cap. One writer thread per store; `get` runs on the caller's thread.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import stat
import struct
import threading
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pagoda.server.kv_tiers.host import pid_alive

logger = logging.getLogger(__name__)

PATH_FLAG = "--kv-offloading-disk-path"
SIZE_FLAG = "--kv-offloading-disk-size"
MAGIC = b"PGKV"
FORMAT_VERSION = 1
SUFFIX = ".kv"
TMP_PREFIX = ".tmp-"
KEY_LENGTHS = (32, 34)  # a sha256 chain hash, or that hash + a 2-byte KV cache group index
_NAME_LENGTHS = frozenset(2 * n for n in KEY_LENGTHS)
_HEAD = struct.Struct("<4sHHHHQ")  # magic, version, identity length, key length, reserved, payload length
_CRC = struct.Struct("<I")
# A temp file this old is abandoned whoever wrote it: a block's write takes milliseconds.
_STALE_TMP_S = 60.0
_GIB = 1 << 30
_FOLDERS = 256  # fan-out folders, by a key's first byte
# At most this many folders relisted per block written (~30 us each): a tier of under ~1000 blocks relists all
# of DIR once per 16 blocks written rather than once per 1/64 of its capacity.
_MAX_RELISTS_PER_WRITE = 16


class DiskTierError(ValueError):
    """A bad --kv-offloading-disk-path / --kv-offloading-disk-size: the message names the flag (the CLI exits 2)."""


@dataclass(frozen=True, slots=True)
class DiskTierStats:
    """Counters and occupancy of one store (this process's view of DIR)."""

    hits: int
    misses: int
    bytes_read: int  # payload bytes served by get()
    bytes_written: int  # payload bytes written to block files
    num_blocks: int
    occupancy_bytes: int  # allocated bytes under DIR: block files, temp files, folders, anything else
    capacity_bytes: int
    dropped_writes: int  # puts refused (queue full, disabled, already stored) or not written
    disabled: bool  # the disk filled or failed: no more writes, reads go on


@dataclass(slots=True)
class _Entry:
    """A block file this store knows: its allocated size and last use (its file's mtime, in ns)."""

    nbytes: int
    access_ns: int


def _allocated(st: os.stat_result) -> int:
    """Bytes a file takes, by either of du's measures (allocated blocks, or apparent size)."""
    return max(st.st_blocks * 512, st.st_size)


def _du(path: Path) -> int:
    """The allocated bytes of everything under `path` (the folder itself included), not following links."""
    total = _allocated(os.lstat(path))
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            with contextlib.suppress(OSError):  # removed meanwhile (another process)
                total += _allocated(os.lstat(os.path.join(root, name)))
    return total


def _now_ns() -> int:
    """The wall clock the tier stamps files with (a function, so that a test can skew it)."""
    return time.time_ns()


def _stale_tmp(name: str, mtime_ns: int) -> bool:
    """Whether a temp file was left by a crash: its writer is gone, or it is older than any write takes."""
    if _now_ns() - mtime_ns > _STALE_TMP_S * 1e9:
        return True
    try:
        pid = int(name[len(TMP_PREFIX) :].split("-", 1)[0])
    except ValueError:
        return True
    return pid != os.getpid() and not pid_alive(pid)


def _write_all(fd: int, header: bytes, payload: bytes) -> None:
    """Write header + payload at the start of `fd` (writev, continuing after a short write)."""
    written = os.writev(fd, [header, payload])
    total = len(header) + len(payload)
    if written < total:
        rest = memoryview(header + payload)[written:]
        while rest:
            rest = rest[os.write(fd, rest) :]


def check_disk_tier(path: str, size_gib: float) -> Path:
    """Validate the flags at start: create DIR (mode 0700, parents as needed) if missing; refuse (DiskTierError naming
    --kv-offloading-disk-path) a path that is a file, not writable, owned by another user, or group/other-writable;
    refuse (naming --kv-offloading-disk-size) a size <= 0, NaN/inf, or larger than the free space of the filesystem
    plus what DIR already holds (an "absurd" size). Returns the resolved path."""
    if isinstance(size_gib, bool) or not isinstance(size_gib, int | float) or not math.isfinite(size_gib):
        raise DiskTierError(f"{SIZE_FLAG} must be a finite number of GiB, got {size_gib!r}")
    if size_gib <= 0:
        raise DiskTierError(f"{SIZE_FLAG} must be > 0 GiB, got {size_gib!r}")
    if not path:
        raise DiskTierError(f"{PATH_FLAG} is empty")
    target = Path(path).expanduser()
    try:
        if not target.exists() and not target.is_symlink():
            os.makedirs(target, mode=0o700)
            os.chmod(target, 0o700)  # makedirs' mode is cut by the umask
        resolved = target.resolve(strict=True)
        st = os.stat(resolved)
    except OSError as exc:
        raise DiskTierError(
            f"{PATH_FLAG} {path}: cannot create or open the folder ({exc.strerror})"
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise DiskTierError(f"{PATH_FLAG} {path} is not a folder")
    if st.st_uid != os.geteuid():
        raise DiskTierError(
            f"{PATH_FLAG} {path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}): "
            "another user could read or plant KV blocks"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise DiskTierError(
            f"{PATH_FLAG} {path} is writable by others (mode {stat.S_IMODE(st.st_mode):o}): "
            "another user could plant KV blocks; chmod 700 it"
        )
    # The owner's bits, checked explicitly: root passes os.access whatever the mode says.
    if st.st_mode & stat.S_IRWXU != stat.S_IRWXU or not os.access(resolved, os.R_OK | os.W_OK | os.X_OK):
        raise DiskTierError(f"{PATH_FLAG} {path} is not writable (mode {stat.S_IMODE(st.st_mode):o})")
    probe = resolved / f"{TMP_PREFIX}{os.getpid()}-probe"
    try:  # what os.access cannot tell: a read-only mount, a full disk, an exhausted inode table
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, b"", bytes(4096))
        finally:
            os.close(fd)
    except OSError as exc:
        raise DiskTierError(f"{PATH_FLAG} {path}: cannot write a block file ({exc.strerror})") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)
    vfs = os.statvfs(resolved)
    free = vfs.f_bavail * vfs.f_frsize
    # What DIR holds (the tier's own files, from before a restart) is room too; walked only when it matters.
    held = _du(resolved) if size_gib * _GIB > free else 0
    if size_gib * _GIB > free + held:
        raise DiskTierError(
            f"{SIZE_FLAG} {size_gib:g} GiB is more than {PATH_FLAG} {resolved} can hold "
            f"({free / _GIB:.2f} GiB free + {held / _GIB:.2f} GiB already in it)"
        )
    return resolved


class DiskKVStore:
    """Block files under DIR keyed by a block's chained hash; async writes, LRU eviction within the size bound."""

    def __init__(
        self,
        path: Path,
        capacity_bytes: int,
        identity: bytes,
        block_bytes: int,
        *,
        max_queued_writes: int = 256,
        rescan_bytes: int | None = None,
    ) -> None:
        """Scan DIR (a restart serves what it holds; crash leftovers are removed), evict down to the capacity and
        start the writer thread. `rescan_bytes`: the writer relists all of DIR once per this many bytes it
        writes (one fan-out folder at a time), to see what other processes sharing DIR wrote or removed: the
        most they can push DIR past the cap before this store sees it (default: 1/64 of the capacity; at least
        16 blocks' worth, as one block written relists at most 16 folders)."""
        if capacity_bytes <= 0 or block_bytes <= 0 or max_queued_writes <= 0:
            raise ValueError("capacity_bytes, block_bytes and max_queued_writes must be > 0")
        if not 0 < len(identity) < 1 << 16:
            raise ValueError(f"identity must be 1..65535 bytes, got {len(identity)}")
        self.path = Path(path)
        self.capacity_bytes = capacity_bytes
        self.identity = bytes(identity)
        self.block_bytes = block_bytes
        self._max_queued = max_queued_writes
        every = rescan_bytes if rescan_bytes is not None else capacity_bytes // 64
        self._rescan_step = max(every // _FOLDERS, 1)  # bytes written per fan-out folder relisted
        self._frsize = os.statvfs(self.path).f_frsize or 4096
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a write done, a put queued, or close
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._folder_keys: dict[str, set[bytes]] = {}  # a fan-out folder's name -> the indexed keys in it
        self._used = 0  # the block files' bytes (sum over the index)
        # Bytes under DIR that are not block files: a folder's own size ("" is DIR), and what else it holds (temp
        # files, files that are not ours); `_overhead` is the sum of both tables.
        self._folder_size: dict[str, int] = {}
        self._other: dict[str, int] = {}
        self._overhead = 0
        self._cycle: deque[str] = deque()  # the fan-out folders still to relist in this round of rescans
        self._pending: dict[bytes, bytes] = {}  # put, not yet on disk (get serves these)
        self._queue: deque[bytes] = deque()
        self._last_ns = 0
        self._tmp_seq = 0
        self._since_rescan = 0
        self._hits = self._misses = self._bytes_read = self._bytes_written = self._dropped = 0
        self._disabled = False
        self._closing = False
        found: list[tuple[int, bytes, int]] = []
        for name in self._scan_root(remove_stale=True):
            entries = self._scan_folder(name, frozenset(), remove_stale=True)
            found += ((e.access_ns, k, e.nbytes) for k, e in entries.items() if e is not None)
        for access_ns, key, nbytes in sorted(found):  # the files' mtimes are the LRU order
            self._index_add(key, _Entry(nbytes, access_ns))
        self._evict_for(0)
        self._thread = threading.Thread(target=self._run, name="pagoda-kv-disk-writer", daemon=True)
        self._thread.start()

    # ---- the caller's side -------------------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        """Whether a block of this key is stored or queued (a stat for a key another process may have written)."""
        self._check_key(key)
        with self._lock:
            if key in self._index or key in self._pending:
                return True
        return os.path.exists(self._file(key.hex()))

    def put(self, key: bytes, payload: bytes | bytearray | memoryview) -> bool:
        """Queue an async write of a block; False (counted in dropped_writes) when the queue is full, the tier is
        disabled or closed, or the key is already stored or queued."""
        self._check_key(key)
        data = payload if isinstance(payload, bytes) else bytes(payload)  # the caller may reuse its buffer
        if len(data) != self.block_bytes:
            raise ValueError(f"a block's payload is {self.block_bytes} bytes, got {len(data)}")
        with self._lock:
            if (
                self._disabled
                or self._closing
                or key in self._index
                or key in self._pending
                or len(self._queue) >= self._max_queued
            ):
                self._dropped += 1
                return False
            self._pending[key] = data
            self._queue.append(key)
            self._changed.notify_all()
        return True

    def get(self, key: bytes) -> bytes | None:
        """The block's payload, read and verified; None on a miss or any mismatch (the bad file is deleted)."""
        self._check_key(key)
        with self._lock:
            queued = self._pending.get(key)
            if queued is not None:
                self._hits += 1
                self._bytes_read += len(queued)
                return queued
        name = self._file(key.hex())
        payload, nbytes, problem = self._read(name, key)
        if payload is None:
            if problem is not None:
                logger.debug("KV disk tier: %s is %s; deleted", name, problem)
                with contextlib.suppress(OSError):
                    os.unlink(name)
            with self._lock:
                self._misses += 1
                self._index_pop(key)
            return None
        with self._lock:
            self._hits += 1
            self._bytes_read += len(payload)
            now = self._tick()
            entry = self._index.get(key)
            if entry is None:  # another process wrote it: now this one accounts for it
                self._index_add(key, _Entry(nbytes, now))
            else:
                entry.access_ns = now
                self._index.move_to_end(key)
        with contextlib.suppress(OSError):  # the mtime is the LRU order a restart and other processes see
            os.utime(name, ns=(now, now))
        return payload

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is on disk (or dropped); False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._pending, timeout)

    def stats(self) -> DiskTierStats:
        """The counters and occupancy now."""
        with self._lock:
            return DiskTierStats(
                hits=self._hits,
                misses=self._misses,
                bytes_read=self._bytes_read,
                bytes_written=self._bytes_written,
                num_blocks=len(self._index),
                occupancy_bytes=self._used + self._overhead,
                capacity_bytes=self.capacity_bytes,
                dropped_writes=self._dropped,
                disabled=self._disabled,
            )

    def close(self) -> None:
        """Graceful stop: write what was queued, then stop the writer thread; idempotent (reads still work)."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._thread.join()

    # ---- files -------------------------------------------------------------------------------------------------

    def _file(self, key_hex: str) -> str:
        """The block file of a key: fanned out by its first byte (folders of a 1 TiB tier hold ~14k files)."""
        return os.path.join(self.path, key_hex[:2], key_hex + SUFFIX)

    @staticmethod
    def _check_key(key: bytes) -> None:
        """TypeError / ValueError for a key that is not 32 or 34 bytes."""
        if not isinstance(key, bytes):
            raise TypeError(f"a block key is bytes, got {type(key).__name__}")
        if len(key) not in KEY_LENGTHS:
            raise ValueError(f"a block key is 32 or 34 bytes, got {len(key)}")

    def _header(self, key: bytes, payload: bytes) -> bytes:
        """A block file's header for this store's identity; the crc32 covers the whole file but itself."""
        head = _HEAD.pack(MAGIC, FORMAT_VERSION, len(self.identity), len(key), 0, len(payload))
        crc = zlib.crc32(payload, zlib.crc32(self.identity + key, zlib.crc32(head)))
        return head + _CRC.pack(crc) + self.identity + key

    def _read(self, name: str, key: bytes) -> tuple[bytes | None, int, str | None]:
        """(payload, allocated bytes, None) of a whole, matching block file; (None, 0, what is wrong) for a bad
        one; (None, 0, None) for a missing or unreadable one (nothing to delete)."""
        offset = _HEAD.size + _CRC.size + len(self.identity) + len(key)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None, 0, None
        try:
            st = os.fstat(fd)
            if st.st_size != offset + self.block_bytes:
                return None, 0, f"{st.st_size} bytes, not {offset + self.block_bytes} (truncated or foreign)"
            header = os.pread(fd, offset, 0)
            payload = os.pread(fd, self.block_bytes, offset)
        except OSError as exc:
            return None, 0, f"unreadable ({exc.strerror})"
        finally:
            os.close(fd)
        if len(header) != offset or len(payload) != self.block_bytes:
            return None, 0, "cut short while being read"
        magic, version, id_len, key_len, reserved, length = _HEAD.unpack_from(header)
        if magic != MAGIC or version != FORMAT_VERSION or reserved != 0:
            return None, 0, "not a block file of this format"
        if (
            id_len != len(self.identity)
            or header[_HEAD.size + _CRC.size : offset - len(key)] != self.identity
        ):
            return None, 0, "of another model, dtype, block size or layout"
        if key_len != len(key) or header[offset - len(key) :] != key:
            return None, 0, "another block's file"
        if length != self.block_bytes:
            return None, 0, f"a {length}-byte block"
        crc = zlib.crc32(
            payload, zlib.crc32(header[_HEAD.size + _CRC.size :], zlib.crc32(header[: _HEAD.size]))
        )
        if crc != _CRC.unpack_from(header, _HEAD.size)[0]:
            return None, 0, "corrupt (checksum mismatch)"
        return payload, _allocated(st), None

    def _scan_root(self, *, remove_stale: bool) -> list[str]:
        """Account for DIR itself and what it holds besides the fan-out folders (removing temp files a crash left
        when `remove_stale`); the fan-out folders' names."""
        folders: list[str] = []
        other = 0
        for top in self._entries(self.path):
            if len(top.name) == 2 and _is_hex(top.name) and top.is_dir(follow_symlinks=False):
                folders.append(top.name)
                continue
            try:  # not ours: counted (the cap bounds everything under DIR), never deleted
                st = top.stat(follow_symlinks=False)
            except OSError:
                continue
            if remove_stale and top.name.startswith(TMP_PREFIX) and _stale_tmp(top.name, st.st_mtime_ns):
                with contextlib.suppress(OSError):
                    os.unlink(top.path)
            else:
                other += _du(Path(top.path)) if stat.S_ISDIR(st.st_mode) else _allocated(st)
        with contextlib.suppress(OSError):
            size = _allocated(os.stat(self.path))
            with self._lock:
                self._set(self._folder_size, "", size)
                self._set(self._other, "", other)
        return sorted(folders)

    def _scan_folder(
        self, name: str, known: frozenset[bytes], *, remove_stale: bool
    ) -> dict[bytes, _Entry | None]:
        """The block files of a fan-out folder (None for a key in `known`: not stat'ed again); accounts for the
        folder's own size and its other files (removing temp files a crash left when `remove_stale`)."""
        folder = os.path.join(self.path, name)
        found: dict[bytes, _Entry | None] = {}
        other = 0
        for entry in self._entries(folder):
            key = _block_key(entry.name, name)
            if key is not None and key in known:
                found[key] = None
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # removed meanwhile
            if key is not None and stat.S_ISREG(st.st_mode):
                found[key] = _Entry(_allocated(st), st.st_mtime_ns)
            elif (
                remove_stale and entry.name.startswith(TMP_PREFIX) and _stale_tmp(entry.name, st.st_mtime_ns)
            ):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
            else:  # a temp file of a live writer, or not ours
                other += _du(Path(entry.path)) if stat.S_ISDIR(st.st_mode) else _allocated(st)
        try:
            size = _allocated(os.stat(folder))
        except OSError:  # gone
            size = 0
        with self._lock:
            self._set(self._folder_size, name, size)
            self._set(self._other, name, other)
        return found

    @staticmethod
    def _entries(folder: str | Path) -> Iterator[os.DirEntry[str]]:
        """A folder's entries; none when it is gone (another process, or a folder that is not readable)."""
        try:
            with os.scandir(folder) as it:
                yield from it
        except OSError:
            return

    # ---- the writer thread -------------------------------------------------------------------------------------

    def _run(self) -> None:
        """Write queued blocks until closed and drained."""
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._queue) or self._closing)
                if not self._queue:
                    return
                key = self._queue.popleft()
                payload = self._pending[key]
            try:
                self._write(key, payload)
            except Exception:  # a bug, not the disk: keep the store usable, say it once per block
                logger.exception("KV disk tier: writing a block failed")
                with self._lock:
                    self._dropped += 1
            finally:
                with self._changed:
                    del self._pending[key]
                    self._changed.notify_all()

    def _write(self, key: bytes, payload: bytes) -> None:
        """Write one block file atomically (temp file, then rename), evicting least recently used ones first."""
        key_hex = key.hex()
        final = self._file(key_hex)
        header = self._header(key, payload)
        estimate = -(-(len(header) + len(payload)) // self._frsize) * self._frsize
        with self._lock:
            refuse = self._disabled or estimate + self._overhead > self.capacity_bytes
            if refuse:
                self._dropped += 1
        if refuse:
            return
        try:
            st = os.stat(final)
        except OSError:
            pass
        else:  # another process wrote it (same content: the key is the content's hash)
            self._adopt(key, _allocated(st), _now_ns())
            return
        folder = os.path.join(self.path, key_hex[:2])
        if key_hex[:2] not in self._folder_size:
            with contextlib.suppress(FileExistsError):
                os.mkdir(folder, 0o700)
        self._evict_for(estimate)
        with self._lock:
            self._tmp_seq += 1
            tmp = os.path.join(folder, f"{TMP_PREFIX}{os.getpid()}-{threading.get_ident()}-{self._tmp_seq}")
            now = self._tick()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            try:
                fd = os.open(tmp, flags, 0o600)
            except FileNotFoundError:  # someone removed the folder: make it again
                with contextlib.suppress(FileExistsError):
                    os.mkdir(folder, 0o700)
                fd = os.open(tmp, flags, 0o600)
            try:
                _write_all(fd, header, payload)
                st = os.fstat(fd)
            finally:
                os.close(fd)
            # Stamped by the tier's clock, not the kernel's (coarser, and behind time_ns by up to a tick): the
            # order of writes and hits is what a restart and other processes read back.
            # No fsync: a process crash keeps the page cache, and after a power loss a block the disk lost is
            # cut short or zeroed, which its length and checksum turn into a miss. fsync would cost ms a block.
            os.utime(tmp, ns=(now, now))
            os.replace(tmp, final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if isinstance(exc, FileNotFoundError):  # another process's start took the temp file for a crash's
                with self._lock:
                    self._dropped += 1
                return
            self._disable(exc)
            return
        self._adopt(key, _allocated(st), now)
        try:  # a folder grows as it gets entries
            size = _allocated(os.stat(folder))
        except OSError:
            size = 0
        with self._lock:
            self._set(self._folder_size, key_hex[:2], size)
            self._bytes_written += len(payload)
            self._since_rescan += _allocated(st)
            steps = min(self._since_rescan // self._rescan_step, _MAX_RELISTS_PER_WRITE)
            self._since_rescan %= self._rescan_step
        for _ in range(steps):
            self._rescan_next()

    def _adopt(self, key: bytes, nbytes: int, access_ns: int) -> None:
        """Account for a block file now in DIR, as the most recently used."""
        with self._lock:
            self._index_add(key, _Entry(nbytes, access_ns))

    def _index_add(self, key: bytes, entry: _Entry) -> None:
        """Index a block file as the most recently used (replacing its entry). Lock held."""
        self._index_pop(key)
        self._index[key] = entry
        self._folder_keys.setdefault(key.hex()[:2], set()).add(key)
        self._used += entry.nbytes

    def _index_pop(self, key: bytes) -> _Entry | None:
        """Drop a key from the index (its file is gone, or going). Lock held."""
        entry = self._index.pop(key, None)
        if entry is not None:
            self._used -= entry.nbytes
            self._folder_keys[key.hex()[:2]].discard(key)
        return entry

    def _set(self, table: dict[str, int], name: str, nbytes: int) -> None:
        """Set a folder's entry in one of the overhead tables, keeping their sum. Lock held."""
        self._overhead += nbytes - table.get(name, 0)
        table[name] = nbytes

    def _evict_for(self, nbytes: int) -> None:
        """Delete least recently used block files until `nbytes` more fit under the capacity."""
        while True:
            with self._lock:
                if not self._index or self._used + self._overhead + nbytes <= self.capacity_bytes:
                    return
                key = next(iter(self._index))
                self._index_pop(key)
            with contextlib.suppress(FileNotFoundError):  # another process evicted it first
                os.unlink(self._file(key.hex()))

    def _rescan_next(self) -> None:
        """Relist the next fan-out folder (DIR itself at the start of each round) to see the block files other
        processes sharing DIR wrote (taken as the most recently used) or removed; evict down to the capacity.
        One folder at a time keeps each pass short (the engine's thread waits on the GIL meanwhile)."""
        if not self._cycle:
            self._cycle.extend(self._scan_root(remove_stale=False))
            if not self._cycle:
                return
        name = self._cycle.popleft()
        with self._lock:
            known = frozenset(self._folder_keys.get(name, ()))
            started = self._tick()
        found = self._scan_folder(name, known, remove_stale=False)
        with self._lock:
            for key in known - found.keys():
                entry = self._index.get(key)
                if entry is not None and entry.access_ns < started:  # not (re)written since the listing began
                    self._index_pop(key)
            for key, new in found.items():
                if new is not None and key not in self._index:
                    self._index_add(key, new)
        self._evict_for(0)

    def _disable(self, exc: OSError) -> None:
        """Stop taking blocks after a write failed (disk full, I/O error, read-only); one warning."""
        with self._lock:
            self._dropped += 1
            if self._disabled:
                return
            self._disabled = True
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        logger.warning(
            "KV disk tier %s: %s (%s); it takes no more blocks, serving goes on",
            self.path,
            "the disk is full" if full else "a block could not be written",
            exc,
        )

    def _tick(self) -> int:
        """A wall-clock time in ns, strictly increasing within this store (LRU order has no ties). Lock held."""
        self._last_ns = max(_now_ns(), self._last_ns + 1)
        return self._last_ns


def _is_hex(text: str) -> bool:
    """Whether `text` is lowercase hex digits, an even number of them (bytes.hex's own spelling)."""
    try:
        return bytes.fromhex(text).hex() == text
    except ValueError:
        return False


def _block_key(name: str, folder: str) -> bytes | None:
    """The key of a block file's name in its fan-out folder, or None for any other name."""
    if (
        not name.endswith(SUFFIX)
        or not name.startswith(folder)
        or len(name) - len(SUFFIX) not in _NAME_LENGTHS
    ):
        return None
    stem = name[: -len(SUFFIX)]
    try:
        key = bytes.fromhex(stem)
    except ValueError:
        return None
    return key if key.hex() == stem else None  # fromhex also takes upper case and spaces
