"""tools/dev.py's pytest workers: two by default, none added where the arguments choose."""

from __future__ import annotations

import pytest
from tool_scripts import load_tool

dev = load_tool("dev.py")


def test_two_workers_each_file_whole_by_default() -> None:
    """A bare run, or one naming tests, gets two xdist workers that keep each file on one worker."""
    default = ["-n", "2", "--dist", "loadfile"]
    assert dev.pytest_workers([]) == default
    assert dev.pytest_workers(["tests/scheduler", "-x", "--durations=20"]) == default


@pytest.mark.parametrize(
    "args",
    [["-n", "0"], ["-n0"], ["-n", "auto"], ["--numprocesses=4"], ["--numprocesses", "1"], ["-p", "no:xdist"]],
)
def test_the_arguments_choose_the_workers(args: list[str]) -> None:
    """Workers named (or xdist turned off) on the command line: dev.py adds nothing."""
    assert dev.pytest_workers(args) == []
