"""Structural conformance: blockalloc's BlockManager is a KVBlockManager, proven by mypy (and its negation fails)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from mypy import api
from pagoda.blockalloc import BlockManager, SlotAllocation
from pagoda.scheduler import ContiguousKVManager, KVBlockManager, SamplingParamsLike, SlotAllocationLike
from pagoda.scheduler.testing import SimSamplingParams

ROOT = Path(__file__).resolve().parents[2]

# Checked by the workspace's mypy run too: these assignments only type-check if the Protocols are satisfied.
_kv: KVBlockManager = BlockManager(4, 4)
_contiguous: KVBlockManager = ContiguousKVManager(BlockManager(4, 4), reserve_tokens=8)
_slot: SlotAllocationLike = SlotAllocation((0,), (), 0)
_params: SamplingParamsLike = SimSamplingParams()


def run_mypy(tmp_path: Path, body: str) -> tuple[int, str]:
    """mypy --strict (the workspace config) on a snippet; exit status and report."""
    snippet = tmp_path / "snippet.py"
    snippet.write_text(textwrap.dedent(body))
    out, err, status = api.run(
        ["--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path / "cache"), str(snippet)]
    )
    return status, out + err


def test_mypy_proves_block_manager_conforms_and_rejects_a_partial_allocator(tmp_path: Path) -> None:
    """`kv: KVBlockManager = BlockManager(...)` type-checks; an allocator lacking `fork` does not."""
    body = """
        from pagoda.blockalloc import BlockManager
        from pagoda.scheduler import KVBlockManager, Scheduler, SchedulerConfig

        kv: KVBlockManager = BlockManager(16, 4, num_host_blocks=4)
        scheduler = Scheduler(SchedulerConfig(), kv)

        class Partial:
            block_size = 4
            num_blocks = 16

            def num_free_blocks(self) -> int:
                return 16

        bad: KVBlockManager = Partial()
        """
    status, report = run_mypy(tmp_path, body)
    bad_line = textwrap.dedent(body).splitlines().index("bad: KVBlockManager = Partial()") + 1
    assert status == 1, report
    errors = [line for line in report.splitlines() if ": error:" in line]
    assert len(errors) == 1 and f"snippet.py:{bad_line}:" in errors[0] and "Partial" in errors[0], report
