"""What the engine tunes when it runs on the CPU: the bfloat16-or-float32 choice, glibc's allocator and the OpenMP
teams of the threads that ran torch."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

import torch
from pagoda.pagedkernel.cbuild import UnsafeCacheError, cache_dir, cpu_signature, private_dir

P = ParamSpec("P")
T = TypeVar("T")

# dtype="auto" on the CPU picks bfloat16 when this CPU multiplies it at least this many times faster than float32:
# CPUs with AMX (Sapphire Rapids and later) measure 5-10x, AVX512-BF16 ones about 2x, older ones below 1x.
BFLOAT16_MIN_SPEEDUP = 1.5
_PROBE_SHAPE = (256, 1024, 1024)  # a decode batch through a small model's projection: where AMX's gain shows
_SCREEN_SHAPE = (64, 256, 256)  # 18 ms in bfloat16 on AVX2
_SCREEN_SLOWER = 0.25  # a screening speedup below this is a CPU without bfloat16 units, not kernel overhead
_DECISIVE_FACTOR = 2.0  # a speedup this many times off the threshold decides the dtype beyond doubt (cached)

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_TRIM_THRESHOLD_BYTES = 1 << 30


def matmul_speedup(m: int, k: int, n: int, rounds: int = 5) -> float:
    """How many times faster this CPU multiplies [m, k] x [k, n] in bfloat16 than in float32 (best of `rounds`)."""
    best: dict[torch.dtype, float] = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
        out = torch.mm(a, b)  # warm-up: the first call may pick and pack kernels
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            times.append(time.perf_counter() - start)
        best[dtype] = min(times)
    return best[torch.float32] / max(best[torch.bfloat16], 1e-9)


def cached_bfloat16_speedup() -> float:
    """`bfloat16_speedup`, kept for later starts when it decides for bfloat16 beyond doubt (at least
    _DECISIVE_FACTOR times BFLOAT16_MIN_SPEEDUP): this CPU measured 5-30x, a probe disturbed by other work on the
    machine 1.5x or even 0.006x, which is measured again at the next start instead of kept.

    The probe took 0.2-0.35 s of every start. Kept beside the compiled kernels (pagedkernel's private cache
    folder), under a name that hashes what the measure depends on: the CPU's model and flags, torch's version and
    its thread count; a file that cannot be read or parsed is measured again.
    """
    path = _speedup_cache_path()
    try:
        cached = json.loads(path.read_text(encoding="utf-8"))["speedup"] if path is not None else None
    except (OSError, ValueError, KeyError, TypeError):
        cached = None
    if isinstance(cached, int | float) and not isinstance(cached, bool) and cached > 0:
        return float(cached)
    speedup = bfloat16_speedup()
    # Only a win is kept: a probe starved by other work on 2 busy cores measured 0.006x on an AMX machine once,
    # and kept, that ran every later start in float32 (5x slower). A CPU without bfloat16 units pays only the
    # screening shape (18 ms) at each start to be measured again.
    decisive = speedup / BFLOAT16_MIN_SPEEDUP >= _DECISIVE_FACTOR
    if path is not None and decisive:
        with contextlib.suppress(OSError, UnsafeCacheError):
            private_dir(path.parent)
            temporary = path.with_suffix(f".{os.getpid()}.tmp")
            temporary.write_text(json.dumps({"speedup": speedup}), encoding="utf-8")
            os.replace(temporary, path)  # atomic: a concurrent start reads no file or a whole one
    return speedup


def _speedup_cache_path() -> Path | None:
    """Where this machine's measured speedup is kept (None: no cache folder can be named)."""
    try:
        folder = cache_dir()
    except RuntimeError:  # no home directory
        return None
    key = f"{cpu_signature()}|{torch.__version__}|{torch.get_num_threads()}"
    return folder / f"bfloat16-speedup-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def bfloat16_speedup(rounds: int = 5) -> float:
    """bfloat16-over-float32 matmul speedup of this CPU: a small screening shape, then a decode-sized one.

    Without bfloat16 units (AVX2 CPUs) torch multiplies bfloat16 about 250x slower than float32 (0.5 GFLOP/s), so
    the decode-sized shape alone would add 7 s to every start; the small shape already tells such a CPU apart.
    """
    screen = matmul_speedup(*_SCREEN_SHAPE, rounds=rounds)
    if screen < _SCREEN_SLOWER:
        return screen
    return matmul_speedup(*_PROBE_SHAPE, rounds=rounds)


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep and reuse freed large blocks instead of unmapping them; False without glibc.

    glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh mmap and unmaps it on
    free, so each step's vocab-wide logits (50-130 MB for a 262k vocabulary) page-faults all of its memory in
    again: 40-70 ms of a 100-170 ms LM-head step, measured. Serving every block from the heap and never trimming
    it makes the next step reuse the same pages (torch's CPU allocator has no cache of its own). This is what
    vLLM's CPU guide gets by preloading tcmalloc; it changes the whole process's allocator, so the engine only
    does it when it runs on the CPU.
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return False  # not glibc (musl, macOS): their mallopt, if any, takes other parameters
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES))


# omp_pause_resource_all's kind: free the resources, keep the OpenMP state (OpenMP 5.0's omp_pause_soft).
_OMP_PAUSE_SOFT = 1


def _loaded_libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's own copy, which the C kernels share), if any."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libgomp" in line.rsplit("/", 1)[-1]), None)
    except OSError:
        return None
    return None if path is None else ctypes.CDLL(path)


def release_openmp_threads() -> bool:
    """Free the calling thread's idle OpenMP team (libgomp's `omp_pause_resource_all`); False where this process
    runs no libgomp (another OpenMP runtime, or none) or it lacks the call.

    libgomp keeps a team of worker threads for every thread that ran a parallel region, and once it manages more
    threads than there are CPUs it has idle workers spin only briefly before sleeping. A server builds the engine
    on its main thread (loading and packing the weights run torch's parallel ops there) and steps it on another:
    two teams on a 2-core machine, so each of a decode step's ~300 parallel regions woke a sleeping worker.
    Measured on a 2-core Sapphire Rapids Xeon, the default model's file (`-q gguf`), one stream: 31.7 ms a decode
    step on the engine thread, 26.7 ms once the main thread's team is freed first (as on the main thread alone).
    A thread that runs parallel ops again later simply gets a new team.
    """
    gomp = _loaded_libgomp()
    pause = None if gomp is None else getattr(gomp, "omp_pause_resource_all", None)
    if pause is None:
        return False
    pause.argtypes = [ctypes.c_int]
    return bool(pause(_OMP_PAUSE_SOFT) == 0)


def run_releasing_openmp(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """fn(*args, **kwargs), then free this thread's OpenMP team: for a helper thread (an adapter loader) whose
    torch ops would otherwise leave a team idling beside the engine thread's."""
    try:
        return fn(*args, **kwargs)
    finally:
        release_openmp_threads()
