"""Compile a C source with given flags into a shared library cached on disk, at first use (as NVRTC does for CUDA).

The system's C compiler (`$CC`, else `cc` or `gcc`) builds `-fPIC -shared` libraries into `cache_dir()`
(`$PAGODA_KERNEL_CACHE`, else `~/.cache/pagoda/cpu-kernels`) under a name that hashes the source, the flags,
the compiler's version and this CPU (so `-march=native` code never runs on another CPU sharing the folder). A
library is written to a temporary file and renamed, so concurrent processes never load half a file. The caller
(a backend, e.g. `cpu_backend`) owns its flags and loads the library with ctypes.

Loading a library runs its code, so the cache is private: its folders are created 0700, and a folder or library
that another user owns, that others may write, or that is a symlink is never used (`check_private`); the build
then goes into a fresh private folder instead, with a warning naming the refused path.

Two errors, both `BackendUnavailableError` (so `auto` falls back to torch on either, with a warning): no compiler
on this machine (`CompilerNotFoundError`), and a compiler that refused the source (`CompileError`, carrying its
exit status and stderr). Tests skip on the first only: a kernel that stops compiling fails them, with gcc's words.

A cached library can be damaged (a truncated file, a full disk, a crash mid-copy): every C library loads through
`load_or_rebuild`, the one rule for that case: load it; else delete it and compile it once more; else raise
`DamagedLibraryError` (a `BackendUnavailableError`, so the caller's torch path runs, with a warning) — a damaged
cache never fails a request.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import stat
import struct
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from pagoda.pagedkernel.backend import BackendUnavailableError

logger = logging.getLogger(__name__)

T = TypeVar("T")

# What every shared library needs, whatever the caller's flags.
SHARED_FLAGS = ("-fPIC", "-shared")
# Mode bits that let someone other than the owner replace a file (group or others may write).
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


class CompilerNotFoundError(BackendUnavailableError):
    """This machine has no C compiler ($CC, else `cc` or `gcc` on PATH): the C kernels cannot be built here."""


class CompileError(BackendUnavailableError):
    """The compiler ran and failed on every alternative: `returncode` and `stderr` are the last attempt's."""

    def __init__(
        self, message: str, command: Sequence[str] = (), returncode: int = 1, stderr: str = ""
    ) -> None:
        super().__init__(message)
        self.command = tuple(command)
        self.returncode = returncode
        self.stderr = stderr

    def __reduce__(self) -> tuple[type[CompileError], tuple[str, tuple[str, ...], int, str]]:
        """Pickled with its fields (the default would rebuild it from the message alone)."""
        return type(self), (str(self.args[0]), self.command, self.returncode, self.stderr)


class DamagedLibraryError(BackendUnavailableError):
    """A cached library failed to load, and the one compiled afresh in its place failed too (to compile or load)."""


class UnsafeCacheError(OSError):
    """A cache folder or library is not private to this user (a symlink, another owner, writable by others)."""


def check_private(path: Path, *, kind: str) -> None:
    """UnsafeCacheError naming `path` unless it is a real `kind` ("dir" or "file"), not a symlink, owned by this
    user and writable by nobody else."""
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeCacheError(f"{path} is a symlink")
    real_kind = stat.S_ISDIR(info.st_mode) if kind == "dir" else stat.S_ISREG(info.st_mode)
    if not real_kind:
        raise UnsafeCacheError(f"{path} is not a {'folder' if kind == 'dir' else 'regular file'}")
    if info.st_uid != os.geteuid():
        raise UnsafeCacheError(f"{path} is owned by uid {info.st_uid}, not by this user ({os.geteuid()})")
    if info.st_mode & _OTHERS_WRITE:
        raise UnsafeCacheError(f"{path} is writable by others (mode {stat.S_IMODE(info.st_mode):o})")


def make_dirs_private(path: Path) -> None:
    """Create `path` and its missing parents, each 0700 (mkdir(parents=True) makes the parents by the umask)."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for folder in reversed(missing):
        folder.mkdir(mode=0o700, exist_ok=True)
        folder.chmod(0o700)  # mkdir's mode is masked by the umask


def private_dir(path: Path) -> Path:
    """`path` created 0700 if missing (its missing parents too), then checked by `check_private`."""
    make_dirs_private(path)
    check_private(path, kind="dir")
    return path


def fresh_private_dir() -> Path:
    """A new folder that only this user can use (mkdtemp makes it 0700), for a build the cache cannot hold."""
    return Path(tempfile.mkdtemp(prefix="pagoda-kernels-"))


def find_compiler() -> str | None:
    """The C compiler to build kernels with: $CC, else `cc` or `gcc` on PATH, else None."""
    names = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc"]
    for name in names:
        path = shutil.which(name)
        if path is not None:
            return path
    return None


def cache_dir() -> Path:
    """Where compiled kernels are kept: $PAGODA_KERNEL_CACHE, else $XDG_CACHE_HOME (or ~/.cache)/pagoda/cpu-kernels."""
    if os.environ.get("PAGODA_KERNEL_CACHE"):
        return Path(os.environ["PAGODA_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pagoda" / "cpu-kernels"


def target_flags(flags: Sequence[str]) -> tuple[str, ...]:
    """`flags` with `-march=native` replaced by `-march=$PAGODA_CPU_MARCH` when that is set (e.g. `x86-64-v3`: every
    kernel built for AVX2 only, as for a fleet of older CPUs, or to measure an AVX2 machine's code on a newer one)."""
    return for_march(flags, os.environ.get("PAGODA_CPU_MARCH", "").strip() or "native")


def for_march(flags: Sequence[str], march: str) -> tuple[str, ...]:
    """`flags` with `-march=native` replaced by `-march={march}` (a kernel's flags built for another target)."""
    return tuple(f"-march={march}" if flag == "-march=native" else flag for flag in flags)


def cpu_signature() -> str:
    """What -march=native depends on: the machine and its CPU flags (so a shared cache never serves another CPU)."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith(("flags", "Features", "model name")):
                flags += line
                if line.startswith(("flags", "Features")):
                    break
    except OSError:
        flags = platform.processor()
    return f"{platform.machine()}|{flags}"


def _cpuinfo_value(key: str) -> str | None:
    """The value of the first /proc/cpuinfo line starting with `key` ("flags", "model name"); None without one."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1]
    except OSError:
        pass
    return None


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (e.g. avx2, amx_bf16); empty where there is none."""
    return frozenset((_cpuinfo_value("flags") or "").split())


def cpu_name() -> str:
    """The CPU's model name, as benchmark tables name their machine."""
    name = _cpuinfo_value("model name")
    return name.strip() if name is not None else platform.processor() or platform.machine()


def build(
    file: str,
    source: str,
    flags: Sequence[str],
    *,
    variant: str,
    owner: str,
    instead: str,
    alternatives: Sequence[Sequence[str]] = ((),),
    libraries: Sequence[str] = (),
) -> Path:
    """Compile `source` (named `file`, e.g. "cpu_attention.c") with `flags` unless the cache has it; the library.

    `variant` names this build in the library's file name (e.g. "float32"). `alternatives` are extra flags tried
    in order until one compiles (e.g. OpenMP, then nothing; none: just `flags`); `libraries` (e.g. "-lm") follow the source on the
    command line. Raises CompilerNotFoundError when there is no compiler, and CompileError (with the compiler's
    output of the last alternative) when every alternative fails, both worded with `owner` (who builds: "the
    'cpu' kernel backend") and `instead` (what to do without it: "use kernel_backend='torch'").
    """
    compiler = find_compiler()
    if compiler is None:
        raise CompilerNotFoundError(
            f"{owner} compiles a C kernel at first use and found no C compiler; install gcc (or set CC), "
            f"or {instead}"
        )
    flags = (*SHARED_FLAGS, *target_flags(flags))
    attempts = [tuple(extra) for extra in alternatives] or [()]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    parts = [source, *flags, *("|".join(extra) for extra in attempts), *libraries, version, cpu_signature()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]
    name = f"{Path(file).stem}_{variant}_{key}.so"
    folder = cache_dir()
    try:
        private_dir(folder)
        target = folder / name
        if target.exists() or target.is_symlink():
            check_private(target, kind="file")
            return target
    except UnsafeCacheError as exc:
        # Loading what someone else could have written would run their code: build a private copy instead.
        folder = fresh_private_dir()
        logger.warning("refusing the kernel cache (%s): building %s into %s instead", exc, name, folder)
        target = folder / name
    return _compile(compiler, file, source, flags, attempts, libraries, target, owner, variant, instead)


def discard(library: Path) -> None:
    """Delete a cached library that failed to load, so that the next `build` compiles it again."""
    library.unlink(missing_ok=True)


# ELF header fields by class (1: 32-bit, 2: 64-bit): program and section header table offsets, then the sizes and
# counts of their entries; and a program header's (p_offset, p_filesz) positions.
_ELF_HEADER = {1: ("I I", 28, "H H H H", 42), 2: ("Q Q", 32, "H H H H", 54)}
_ELF_SEGMENT = {1: ("I", 4, "I", 16), 2: ("Q", 8, "Q", 32)}
_PT_LOAD = 1


def check_whole(library: Path) -> None:
    """OSError unless the ELF file `library` holds every byte its headers point at (its segments, its header tables).

    dlopen maps a truncated library without complaint when its headers survive, and the process dies of SIGBUS
    at the first touch of a missing page: a truncated file must never reach it. A file that is not ELF at all is
    left to the loader, which refuses it.
    """
    data = library.read_bytes()
    if data[:4] != b"\x7fELF":
        return
    if len(data) < 64 or data[4] not in _ELF_HEADER or data[5] not in (1, 2):
        raise OSError(f"{library} is truncated or damaged ({len(data)} bytes, no whole ELF header)")
    try:
        needed = _elf_end(data)
    except struct.error as exc:  # a program header table cut off mid-entry
        raise OSError(f"{library} is truncated or damaged ({exc})") from exc
    if len(data) < needed:
        raise OSError(f"{library} is truncated ({len(data)} of at least {needed} bytes)")


def _elf_end(data: bytes) -> int:
    """The end of the furthest byte an ELF file's headers point at (header tables, loaded segments)."""
    order = "<" if data[5] == 1 else ">"
    offsets, at, counts, counts_at = _ELF_HEADER[data[4]]
    phoff, shoff = struct.unpack_from(order + offsets, data, at)
    phentsize, phnum, shentsize, shnum = struct.unpack_from(order + counts, data, counts_at)
    needed = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    if phoff + phentsize * phnum <= len(data):
        word, offset_at, _, filesz_at = _ELF_SEGMENT[data[4]]
        for index in range(phnum):
            header = phoff + index * phentsize
            if struct.unpack_from(order + "I", data, header)[0] != _PT_LOAD:
                continue
            (offset,) = struct.unpack_from(order + word, data, header + offset_at)
            (filesz,) = struct.unpack_from(order + word, data, header + filesz_at)
            needed = max(needed, offset + filesz)
    return int(needed)


def load_or_rebuild(build: Callable[[], Path], load: Callable[[Path], T], *, owner: str) -> T:
    """`load(build())`; a library that fails to load (OSError: a damaged file) is deleted, built and loaded once more.

    The first `build`'s errors propagate as they are (no compiler: `CompilerNotFoundError`, a kernel that does not
    compile: `CompileError`, which tests must see). When the rebuilt library fails to load too, or the rebuild
    itself fails, `DamagedLibraryError` (a BackendUnavailableError, chained to the cause) says so, naming the
    library and `owner` (who loads it: "the 'cpu' fused ops"): the caller runs its torch path instead.
    """
    library = build()
    try:
        check_whole(library)
        return load(library)
    except OSError as exc:
        logger.warning("%s: the cached %s failed to load (%s); compiling it again", owner, library, exc)
    discard(library)
    try:
        library = build()
        check_whole(library)
        return load(library)
    except (BackendUnavailableError, OSError) as exc:
        raise DamagedLibraryError(
            f"{owner}: {library} failed to load and compiling it again did not mend it ({exc})"
        ) from exc


def _compile(
    compiler: str,
    file: str,
    source: str,
    flags: Sequence[str],
    attempts: Sequence[Sequence[str]],
    libraries: Sequence[str],
    target: Path,
    owner: str,
    variant: str,
    instead: str,
) -> Path:
    """Compile into `target` (in a checked private folder) through a temporary file renamed into place."""
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / file
        src.write_text(source, encoding="utf-8")
        lib = Path(tmp) / target.name
        for extra in attempts:
            command = [compiler, *flags, *extra, str(src), "-o", str(lib), *libraries]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode == 0:
                break
        else:
            raise CompileError(
                f"compiling {owner}'s {file} for {variant} failed ({compiler} exit {done.returncode}):\n"
                f"{done.stderr.strip()}\n{instead} instead",
                command=command,
                returncode=done.returncode,
                stderr=done.stderr,
            )
        lib.chmod(0o700)  # whatever the umask: a group-writable library would be refused at the next load
        os.replace(lib, target)  # atomic: a concurrent process sees no file or a whole one
    return target
