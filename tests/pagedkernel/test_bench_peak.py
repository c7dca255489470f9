"""Smoke test of tools/bench_peak.py: every kind this CPU has is measured, a bad flag exits 2 naming it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pagoda.pagedkernel.cbuild import cpu_flags, cpu_name

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    """tools/bench_peak.py with `args`."""
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_peak.py"), *args],
        capture_output=True,
        text=True,
        check=False,
    )


def test_bench_peak_measures_what_the_cpu_has(tmp_path: Path) -> None:
    """float32 FMA and int8 dot products wherever AVX2 is (the CI machines), bfloat16 where AVX-512 BF16 is; each
    rate positive; the table names the CPU."""
    out = tmp_path / "peak.json"
    result = run("--seconds", "0.02", "--repeats", "1", "--json", str(out))
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert data["cpu"] == cpu_name()
    kinds = [p["kind"] for p in data["peaks"]]
    flags = cpu_flags()
    expected = ["float32 FMA", "int8 dot"] if "avx2" in flags else []
    if "avx512_bf16" in flags:
        expected.append("bfloat16 dot")
    assert kinds == expected
    for p in data["peaks"]:
        assert p["one_thread_gmacs"] > 0 and p["all_threads_gmacs"] > 0 and p["threads"] == 2
    lines = result.stdout.splitlines()
    assert lines[0].startswith(cpu_name()) and "2 threads" in lines[1]
    assert len(lines) == 2 + len(kinds)


def test_bad_flag_exits_2_naming_it() -> None:
    result = run("--threads", "0")
    assert result.returncode == 2 and "--threads" in result.stderr
