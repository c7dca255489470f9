"""Smoke test of tools/bench_native_decode.py --tiny: a tiny random Q8_0 GGUF Gemma 3 decoded with its native
decode layers off and on, one line per mode."""

from __future__ import annotations

import re

import pytest
import torch
from pagoda.server.models.gemma3 import Gemma3ForCausalLM
from tool_scripts import load_tool

bench = load_tool("bench_native_decode.py")


def test_tiny_gemma3_prints_both_modes(capsys: pytest.CaptureFixture[str]) -> None:
    """Both modes report a forward and a wall time per step, the native layers ran, and the model class's forward
    (timed by the tool while it runs) is its own again afterwards."""
    forward, threads = Gemma3ForCausalLM.forward, torch.get_num_threads()
    args = ["--tiny", "gemma3", "--dtype", "float32", "--threads", "1", "--rounds", "1", "--steps", "4"]
    try:
        assert bench.main([*args, "--prompt-len", "8"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert Gemma3ForCausalLM.forward is forward
    out = capsys.readouterr().out
    native = re.search(r"rows 1, load [\d.]+, native steps (\d+)", out)
    assert native and int(native[1]) > 0, out
    for mode in ("modules", "native"):
        line = re.search(
            rf"{mode}: forward median ([\d.]+) ms over (\d+) steps; wall per step median ([\d.]+) ms", out
        )
        assert line and float(line[1]) > 0 and int(line[2]) >= 1 and float(line[3]) > 0, out
