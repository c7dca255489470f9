"""Smoke test of tools/bench_quant.py: tiny shapes, every system timed, K-quants skipped where K does not fit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_bench_quant_quick(tmp_path: Path) -> None:
    """Two shapes x two formats x two batch sizes: Q4_K only on the shape whose K is a multiple of 256."""
    out = tmp_path / "bench.json"
    args = ["--shape", "a=96x64", "b=40x256", "--formats", "Q4_0", "Q4_K", "--rows", "1", "20"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_quant.py"), *args, "--repeats", "1", "--json", str(out)],
        check=True,
        capture_output=True,
        text=True,
    )
    data = json.loads(out.read_text())
    assert data["probe_gbps"] > 0
    points = data["points"]
    assert [(p["shape"], p["format"], p["rows"]) for p in points] == [
        ("a", "Q4_0", 1),
        ("a", "Q4_0", 20),
        ("b", "Q4_0", 1),
        ("b", "Q4_K", 1),
        ("b", "Q4_0", 20),
        ("b", "Q4_K", 20),
    ]
    packed = torch._C._has_mkldnn and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    # oneDNN packs bfloat16 only where the CPU has its bfloat16 path (not on AVX2-only CPUs)
    packed_bf16 = packed and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    for p in points:
        assert all(p[key] > 0 for key in ("qmatmul_ms", "qmatmul_bf16_ms", "deq_mm_ms", "bf16_ms", "f32_ms"))
        # the engine's dense paths
        for key, present in (("packed_ms", packed_bf16), ("packed_f32_ms", packed)):
            assert (p[key] > 0) if present else p[key] is None
    lines = result.stdout.splitlines()
    assert (
        "threads" in lines[0] and "GB/s" in lines[0] and "AMX matmul" in lines[0] and "BF16 one" in lines[0]
    )
    assert "vs bf16" in lines[1] and "packed" in lines[1] and "packed f32" in lines[1]
    assert len(lines) == 3 + len(points)
