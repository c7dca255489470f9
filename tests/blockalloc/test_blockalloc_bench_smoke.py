"""Smoke test of tools/bench_blockalloc.py with tiny sizes (no timing assertions)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench_blockalloc.py"


def load_bench() -> ModuleType:
    """Import the benchmark script as a module."""
    spec = importlib.util.spec_from_file_location("bench_blockalloc", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_bench_main_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    """main() runs every workload on both allocators (which must agree) and prints one row each."""
    bench = load_bench()
    assert bench.main(["--num-seqs", "12", "--max-len", "256", "--block-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "block op = one block allocated" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "workload" not in line]
    assert len(rows) == 3
    assert "64 shared prefixes" in rows[2]


def test_bench_workloads_leave_a_consistent_empty_pool() -> None:
    """Each workload on Pagoda's allocator ends with every block free and the invariants intact."""
    bench = load_bench()
    for workload in bench.workloads(30, 256, 8, 1):
        manager = bench.make_pagoda(workload)
        driver = bench.Driver(manager, workload)
        driver.run(lambda: None)
        manager.check_invariants()
        assert manager.num_free_blocks() == workload.num_blocks
        assert driver.ops > 0
        assert (driver.hit_tokens > 0) == (workload.shared_prefixes > 0)
