"""What the engine tunes when it runs on the CPU: the bfloat16-or-float32 choice and glibc's allocator."""

from __future__ import annotations

import ctypes
import ctypes.util
import time

import torch

# dtype="auto" on the CPU picks bfloat16 when this CPU multiplies it at least this many times faster than float32:
# CPUs with AMX (Sapphire Rapids and later) measure 5-10x, AVX512-BF16 ones about 2x, older ones below 1x.
BFLOAT16_MIN_SPEEDUP = 1.5
_PROBE_SHAPE = (256, 1024, 1024)  # a decode batch through a small model's projection: where AMX's gain shows
_SCREEN_SHAPE = (64, 256, 256)  # 18 ms in bfloat16 on AVX2
_SCREEN_SLOWER = 0.25  # a screening speedup below this is a CPU without bfloat16 units, not kernel overhead

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
