"""engine/host.py and the dtype choice: the measured bfloat16 probe and the glibc allocator tuning."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from pagoda.server.config import EngineConfig
from pagoda.server.engine import host, setup

# Prints the bytes glibc holds in mmapped chunks before and after a 64 MiB tensor is allocated, twice: with the
# default allocator settings, then after keep_freed_memory() (and one allocate/free to grow the heap).
_PROBE = """
import ctypes, torch
from pagoda.server.engine.host import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2

def mapped_growth():
    before = libc.mallinfo2().hblkhd
    tensor = torch.ones(16 << 20)  # 64 MiB of float32
    grown = libc.mallinfo2().hblkhd - before
    del tensor
    return grown

default = mapped_growth()
assert keep_freed_memory()
torch.ones(16 << 20)  # freed at once: the heap now has room for the next one
print(default, mapped_growth())
"""


def glibc_has_mallinfo2() -> bool:
    """mallinfo2 appeared in glibc 2.33."""
    try:
        import ctypes

        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not glibc_has_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
def test_keep_freed_memory_serves_large_blocks_from_the_heap() -> None:
    """By default a 64 MiB tensor is a fresh mmap; after keep_freed_memory() it comes from the reused heap."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, timeout=120
    )
    default, tuned = (int(v) for v in done.stdout.split())
    assert default >= 64 << 20
    assert tuned == 0


def test_matmul_speedup_is_a_measured_ratio() -> None:
    """One shape's probe returns a positive, finite ratio of two timings."""
    ratio = host.matmul_speedup(32, 64, 64, rounds=2)
    assert ratio > 0 and math.isfinite(ratio)


@pytest.mark.parametrize(("screen", "shapes"), [(0.01, 1), (0.9, 2), (6.0, 2)])
def test_bfloat16_probe_stops_after_the_screen_on_a_cpu_without_units(
    monkeypatch: pytest.MonkeyPatch, screen: float, shapes: int
) -> None:
    """A screening speedup far below 1 is the answer; anything else is measured again at the decode-sized shape."""
    measured: list[tuple[int, int, int]] = []

    def probe(m: int, k: int, n: int, rounds: int) -> float:
        measured.append((m, k, n))
        return screen if len(measured) == 1 else 3.0

    monkeypatch.setattr(host, "matmul_speedup", probe)
    assert host.bfloat16_speedup() == (screen if shapes == 1 else 3.0)
    assert measured == [host._SCREEN_SHAPE, host._PROBE_SHAPE][:shapes]


@pytest.mark.parametrize(("speedup", "expected"), [(8.0, torch.bfloat16), (1.2, torch.float32)])
def test_auto_dtype_on_cpu_follows_the_measured_speedup(
    monkeypatch: pytest.MonkeyPatch, speedup: float, expected: torch.dtype
) -> None:
    """auto picks bfloat16 on a CPU whose bfloat16 matmul is fast enough, float32 otherwise."""
    monkeypatch.setattr(setup, "cached_bfloat16_speedup", lambda: speedup)
    assert setup.select_dtype(EngineConfig(), torch.device("cpu")) == expected


def test_explicit_dtype_and_cuda_skip_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """A configured dtype is used as is; CUDA's auto is bfloat16; neither measures anything."""

    def probe() -> float:
        raise AssertionError("the probe ran")

    monkeypatch.setattr(setup, "cached_bfloat16_speedup", probe)
    assert setup.select_dtype(EngineConfig.from_flat(dtype="float32"), torch.device("cpu")) == torch.float32
    assert setup.select_dtype(EngineConfig.from_flat(dtype="bfloat16"), torch.device("cpu")) == torch.bfloat16
    assert setup.select_dtype(EngineConfig(), torch.device("cuda")) == torch.bfloat16


@pytest.mark.parametrize(
    ("speedup", "kept"), [(8.0, True), (3.0, True), (2.0, False), (1.0, False), (0.5, False), (0.006, False)]
)
def test_a_decisive_speedup_is_kept_for_the_next_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, speedup: float, kept: bool
) -> None:
    """A speedup at least twice the 1.5x threshold is measured once and read back at the next start; one below
    that (a probe disturbed by a busy machine, or a CPU without bfloat16 units, which pays only the small
    screening shape) is measured again every time; a damaged file is measured again."""
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path / "cache"))
    probes: list[float] = []

    def probe() -> float:
        probes.append(speedup)
        return speedup

    monkeypatch.setattr(host, "bfloat16_speedup", probe)
    assert host.cached_bfloat16_speedup() == speedup
    assert host.cached_bfloat16_speedup() == speedup
    assert len(probes) == (1 if kept else 2)
    files = list((tmp_path / "cache").glob("bfloat16-speedup-*.json"))
    assert len(files) == (1 if kept else 0)
    if kept:
        assert (tmp_path / "cache").stat().st_mode & 0o077 == 0  # the kernels' private folder
        files[0].write_text("{not json", encoding="utf-8")
        assert host.cached_bfloat16_speedup() == speedup
        assert len(probes) == 2


# In a fresh process: a thread runs a parallel torch op (its OpenMP team starts a worker), frees its team, then
# runs another through run_releasing_openmp; prints the thread counts at each point, the release's result and the
# wrapped call's value.
_OPENMP_PROBE = """
import os, threading, time, torch
from pagoda.server.engine.host import release_openmp_threads, run_releasing_openmp

torch.set_num_threads(2)

def tasks():
    return len(os.listdir("/proc/self/task"))

seen = {}

def work():
    x = torch.ones(1 << 24)
    (x * 2).sum()
    seen["team"] = tasks()
    seen["released"] = release_openmp_threads()
    time.sleep(0.2)
    seen["after"] = tasks()
    seen["value"] = run_releasing_openmp(lambda y: int((y * 3).sum().item()), x)
    time.sleep(0.2)
    seen["after_run"] = tasks()

thread = threading.Thread(target=work)
thread.start()
thread.join()
print(seen["team"], seen["released"], seen["after"], seen["value"], seen["after_run"])
"""


def test_release_openmp_threads_frees_the_calling_threads_team() -> None:
    """A thread's idle OpenMP team (what a server's main thread keeps after building the engine) ends its workers
    when released; run_releasing_openmp returns the call's value and leaves no team behind either."""
    done = subprocess.run(
        [sys.executable, "-c", _OPENMP_PROBE], capture_output=True, text=True, check=True, timeout=120
    )
    team, released, after, value, after_run = done.stdout.split()
    if released == "False":
        pytest.skip("this torch runs no libgomp with omp_pause_resource_all")
    assert int(after) < int(team)
    assert int(value) == 3 << 24
    assert int(after_run) == int(after)


def test_the_server_frees_the_builders_team_before_stepping(monkeypatch: pytest.MonkeyPatch) -> None:
    """AsyncLLM.start releases the OpenMP team of the thread that built the engine (the event loop's), before the
    engine thread exists."""
    from api_fake_engine import FakeEngine
    from pagoda.server import async_llm

    calls: list[tuple[str, bool]] = []

    def release() -> bool:
        calls.append(
            (threading.current_thread().name, "pagoda-engine" in {t.name for t in threading.enumerate()})
        )
        return True

    monkeypatch.setattr(async_llm, "release_openmp_threads", release)
    llm = async_llm.AsyncLLM(FakeEngine())

    async def start_and_stop() -> None:
        llm.start()
        await asyncio.to_thread(llm.shutdown)

    asyncio.run(start_and_stop())
    assert calls == [(threading.current_thread().name, False)]
