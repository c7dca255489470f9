"""examples/blockalloc_alone.py: the allocator driving a numpy paged attention, in a process without torch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "blockalloc_alone.py"

# Runs the example as __main__, then reports which heavy modules the process imported.
RUNNER = f"""
import runpy, sys
try:
    runpy.run_path({str(EXAMPLE)!r}, run_name="__main__")
except SystemExit as exit:
    if exit.code not in (0, None):
        raise
print("heavy modules:", sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "triton")))
"""


def test_blockalloc_alone_runs_without_torch_and_shares_blocks() -> None:
    """The example exits 0 (its paged attention equals dense attention), imports no torch, and its block
    tables show prefix sharing, copy-on-write after a fork, and eviction of chain tails before heads."""
    proc = subprocess.run([sys.executable, "-c", RUNNER], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "heavy modules: []" in out
    assert "every paged attention output equals dense attention" in out
    tables = [
        (name, [int(b) for b in blocks.split(", ")])
        for name, blocks in re.findall(r"table (\w+): \[([\d, ]+)\]", out)
    ]
    names = [name for name, _ in tables]
    assert names == ["A", "B", "C", "A", "B", "C", *(f"D{i}" for i in range(7))]
    (_, a), (_, b), (_, c), (_, a2), (_, b2), (_, c2) = tables[:6]
    assert a[:2] == b[:2] and a[2] != b[2]  # the 8-token system prompt: two shared blocks, suffixes apart
    assert c == a  # a fork shares every block
    assert a2[:2] == b2[:2] == c2[:2] and c2[2] == a[2] and a2[2] != a[2]  # A's write copied the shared block
    assert f"copy-on-write (({a[2]}, {a2[2]}),)" in out
    # D1..D6 take one block each, evicting cached blocks least recently freed first (B, then A, then C were
    # freed), each sequence tail first, so the shared system-prompt blocks go last, tail before head.
    evicted = [blocks[0] for _, blocks in tables[7:]]
    assert evicted == [b2[3], b2[2], a2[2], c2[2], a[1], a[0]]
