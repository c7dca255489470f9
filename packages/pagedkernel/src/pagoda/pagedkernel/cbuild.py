"""Compile a C source with given flags into a shared library cached on disk, at first use (as NVRTC does for CUDA).

The system's C compiler (`$CC`, else `cc` or `gcc`) builds `-fPIC -shared` libraries into `cache_dir()`
(`$PAGODA_KERNEL_CACHE`, else `~/.cache/pagoda/cpu-kernels`) under a name that hashes the source, the flags,
the compiler's version and this CPU (so `-march=native` code never runs on another CPU sharing the folder). A
library is written to a temporary file and renamed, so concurrent processes never load half a file. The caller
(a backend, e.g. `cpu_backend`) owns its flags and loads the library with ctypes.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from pagoda.pagedkernel.backend import BackendUnavailableError

# What every shared library needs, whatever the caller's flags.
SHARED_FLAGS = ("-fPIC", "-shared")


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


def cpu_name() -> str:
    """The CPU's model name, as benchmark tables name their machine."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
    command line. Raises BackendUnavailableError, worded with `owner` (who builds: "the 'cpu' kernel backend")
    and `instead` (what to do without it: "use kernel_backend='torch'"), when there is no compiler or every
    alternative fails (with the compiler's output of the last).
    """
    compiler = find_compiler()
    if compiler is None:
        raise BackendUnavailableError(
            f"{owner} compiles a C kernel at first use and found no C compiler; install gcc (or set CC), "
            f"or {instead}"
        )
    flags = (*SHARED_FLAGS, *flags)
    attempts = [tuple(extra) for extra in alternatives] or [()]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    parts = [source, *flags, *("|".join(extra) for extra in attempts), *libraries, version, cpu_signature()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]
    target = cache_dir() / f"{Path(file).stem}_{variant}_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
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
            raise BackendUnavailableError(
                f"compiling {owner}'s {file} for {variant} failed ({compiler} exit {done.returncode}):\n"
                f"{done.stderr.strip()}\n{instead} instead"
            )
        os.replace(lib, target)  # atomic: a concurrent process sees no file or a whole one
    return target
