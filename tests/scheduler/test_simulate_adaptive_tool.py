"""tools/simulate_adaptive.py on a short trace: the table names the machine's costs and rates each profile."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "simulate_adaptive.py"


def load_tool() -> ModuleType:
    """Import the script as a module."""
    spec = importlib.util.spec_from_file_location("simulate_adaptive", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("machine", "fixed_ms"), [("modules", "17 ms"), ("native", "8.16 ms")])
def test_the_table_names_the_machine_and_has_a_row_per_profile(machine: str, fixed_ms: str) -> None:
    """--machine picks the step costs the header names; one row per profile, adaptive with its two ratios."""
    rows = load_tool().main(["--machine", machine, "--chat-rates", "2", "--phase-seconds", "4"])
    assert rows[0].startswith(f"fake machine: {fixed_ms} + ")
    assert [row.split(" | ")[1] for row in rows[2:]] == [
        "default",
        "throughput",
        "latency",
        "balanced",
        "adaptive",
    ]
    assert rows[-1].count("x") == 2


def test_a_bad_machine_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown machine is refused by argparse (exit 2, naming --machine)."""
    with pytest.raises(SystemExit) as exit_info:
        load_tool().main(["--machine", "gpu"])
    assert exit_info.value.code == 2
    assert "--machine" in capsys.readouterr().err
