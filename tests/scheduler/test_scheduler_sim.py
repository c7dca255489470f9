"""The simulation helpers (contiguous adapter, token model) and smoke runs of the scheduler tools."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from pagoda.blockalloc import BlockManager
from pagoda.scheduler import ContiguousKVManager, Request, Scheduler, SchedulerConfig
from pagoda.scheduler.testing import (
    SimSamplingParams,
    TokenCacheModel,
    reference_output,
    run_to_completion,
)

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(name: str) -> ModuleType:
    """Import tools/<name>.py (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"pagoda_tool_{name}", TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_contiguous_manager_reserves_the_full_length_at_admission() -> None:
    """Each sequence holds ceil(reserve / block size) blocks from its first slot; none when they do not fit."""
    kv = ContiguousKVManager(BlockManager(10, 4, enable_prefix_caching=False), reserve_tokens=16)
    assert kv.blocks_per_seq == 4 and kv.num_blocks_needed("a", 1) == 4
    first = kv.allocate_slots("a", [1, 2], 2)
    assert first is not None and len(first.slots) == 2
    assert kv.num_free_blocks() == 6 and kv.stats().num_used_blocks == 4 and kv.num_blocks_needed("a", 5) == 0
    assert kv.allocate_slots("b", [3], 1) is not None
    assert kv.allocate_slots("c", [4], 1) is None and not kv.has_seq("c")
    with pytest.raises(ValueError, match="c"):
        kv.fork("a", "c")
    kv.free("a")
    assert kv.num_free_blocks() == 6 and kv.allocate_slots("c", [4], 1) is not None
    assert not kv.can_swap_out("b") and kv.swap_out("b") is None and kv.get_num_cached_tokens([3]) == 0


def test_scheduler_over_contiguous_memory_admits_fewer_and_stays_exact() -> None:
    """With max-length reservations only two requests run at once, and the tokens are still the reference."""
    inner = BlockManager(16, 4, enable_prefix_caching=False)
    kv = ContiguousKVManager(inner, reserve_tokens=32)
    sched = Scheduler(SchedulerConfig(max_model_len=32, enable_prefix_caching=False, watermark=0.0), kv)
    model = TokenCacheModel(16, 4)
    requests = [Request(f"r{i}", [i + 1, 2, 3], SimSamplingParams(max_tokens=5 + i)) for i in range(5)]
    for r in requests:
        sched.add_request(r)

    def check(_: object) -> None:
        assert len(sched.running) <= 2
        inner.check_invariants()

    run_to_completion(sched, model, after_schedule=check)
    for r in requests:
        assert list(r.output_token_ids) == reference_output(r.prompt_token_ids, r.sampling_params, 32)
    assert kv.num_free_blocks() == 16


def test_token_model_detects_a_wrong_slot() -> None:
    """The stand-in runner refuses a slot that does not match the block table (so the tests can fail)."""
    sched = Scheduler(SchedulerConfig(max_model_len=16), BlockManager(8, 4))
    sched.add_request(Request("a", [1, 2, 3], SimSamplingParams(max_tokens=2)))
    out = sched.schedule()
    chunk = out.scheduled[0]
    broken = dataclasses.replace(out, scheduled=(chunk._replace(slots=(9, 10, 11)),))
    with pytest.raises(AssertionError):
        TokenCacheModel(8, 4).execute(broken)


def test_simulate_tool_runs_both_modes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """tools/simulate.py: the four-system table and plot, then the block-size sweep, at toy sizes."""
    simulate = load_tool("simulate")
    common = ["--num-requests", "12", "--rate", "40", "--kv-tokens", "1024", "--max-model-len", "256"]
    common += ["--max-num-batched-tokens", "256", "--system-prompt-len", "16", "--measure-every", "1"]
    assert simulate.main([*common, "--out", str(tmp_path / "sim.png")]) == 0
    report = capsys.readouterr().out
    for name in (
        "static + contiguous",
        "continuous + contiguous",
        "continuous + paged",
        "paged + prefix cache",
    ):
        assert name in report
    assert (tmp_path / "sim.png").stat().st_size > 0
    assert simulate.main([*common, "--sweep-block-size", "--out", str(tmp_path / "sweep.png")]) == 0
    report = capsys.readouterr().out
    assert "fragmentation" in report and (tmp_path / "sweep.png").stat().st_size > 0


def test_bench_scheduler_tool_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """tools/bench_scheduler.py at toy sizes prints its table (no timing assertions)."""
    bench = load_tool("bench_scheduler")
    assert bench.main(["--sizes", "4", "8", "--steps", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split()[:1] == ["8"] for line in lines)


@pytest.mark.parametrize(("machine", "fixed_ms"), [("modules", "17 ms"), ("native", "8.16 ms")])
def test_simulate_adaptive_names_the_machine_and_has_a_row_per_profile(machine: str, fixed_ms: str) -> None:
    """tools/simulate_adaptive.py: --machine picks the step costs the header names; one row per profile, adaptive
    with its two ratios."""
    rows = load_tool("simulate_adaptive").main(
        ["--machine", machine, "--chat-rates", "2", "--phase-seconds", "4"]
    )
    assert rows[0].startswith(f"fake machine: {fixed_ms} + ")
    profiles = [row.split(" | ")[1] for row in rows[2:]]
    assert profiles == ["default", "throughput", "latency", "balanced", "adaptive"]
    assert rows[-1].count("x") == 2


def test_simulate_adaptive_refuses_a_bad_machine(capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown --machine is refused by argparse (exit 2, naming the flag)."""
    with pytest.raises(SystemExit) as exit_info:
        load_tool("simulate_adaptive").main(["--machine", "gpu"])
    assert exit_info.value.code == 2
    assert "--machine" in capsys.readouterr().err
