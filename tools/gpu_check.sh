#!/usr/bin/env bash
# Every GPU test and the kernel benchmark, in one command, on a CUDA machine set up as the README's GPU install
# says (.venv with a CUDA torch, triton and cupy). Installs nothing. Prints a short summary table last.
#
#     bash tools/gpu_check.sh            # logs and JSON go to a fresh temporary folder (printed)
#     GPU_CHECK_OUT=dir bash tools/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."

if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
OUT=${GPU_CHECK_OUT:-$(mktemp -d -t pagoda-gpu-check.XXXXXX)}
mkdir -p "$OUT"
echo "gpu_check: python $PY, logs in $OUT"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: torch sees no CUDA device; install the CUDA build of torch (see README, GPU install)" >&2
    exit 1
fi
"$PY" -c "import torch; print('gpu_check:', torch.cuda.get_device_name(0), 'torch', torch.__version__, 'cuda', torch.version.cuda)"

# All GPU tests of every package, in one process (tests/conftest.py leaves Triton compiled where CUDA is).
"$PY" -m pytest tests -m gpu -q -rs -p no:cacheprovider --junitxml "$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/pytest.log"
tests_rc=${PIPESTATUS[0]}

"$PY" tools/bench_kernels.py --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>"$OUT/bench.stderr" | tee "$OUT/bench.txt"
bench_rc=${PIPESTATUS[0]}
[ "$bench_rc" -eq 0 ] || tail -n 20 "$OUT/bench.stderr" >&2

# Tensor parallelism over every GPU of the machine (NCCL, the mp executor): TP=1 on one GPU against TP=N on the
# default model, same greedy workload in bfloat16; the report has both rates, rank 0's time in collectives per step
# and the share of requests whose tokens equal TP=1's (bfloat16 sums in another order may flip a close argmax).
NUM_GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
tp_rc=0
if [ "$NUM_GPUS" -ge 2 ]; then
    "$PY" tools/bench_throughput.py --tensor-parallel-size "$NUM_GPUS" --num-requests 64 --max-prompt-len 256 \
        --min-output-len 64 --max-output-len 64 --json "$OUT/tp.json" 2>"$OUT/tp.stderr" | tee "$OUT/tp.txt"
    tp_rc=${PIPESTATUS[0]}
    [ "$tp_rc" -eq 0 ] || tail -n 20 "$OUT/tp.stderr" >&2
else
    echo "gpu_check: $NUM_GPUS GPU: no tensor-parallel run (it needs two or more)"
fi

"$PY" - "$OUT" "$tests_rc" "$bench_rc" "$tp_rc" <<'PYEOF'
"""Summary: GPU test outcomes per file, each benchmark row's bandwidth as a share of the copy bandwidth, the TP run."""
import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

out, tests_rc, bench_rc, tp_rc = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
print("\n==================== gpu_check summary ====================")
counts: dict[str, Counter[str]] = {}
junit = out / "gpu_tests.xml"
if junit.exists():
    for case in ET.parse(junit).iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
        counts.setdefault(case.get("classname", "?"), Counter())[outcome] += 1
print(f"{'test module':<50} {'passed':>6} {'failed':>6} {'error':>6} {'skipped':>7}")
for name, c in sorted(counts.items()):
    print(f"{name:<50} {c['passed']:>6} {c['failure']:>6} {c['error']:>6} {c['skipped']:>7}")
bench = out / "bench.json"
if bench.exists():
    data = json.loads(bench.read_text())
    print(f"\ncopy bandwidth {data['copy_gb_per_s']:.0f} GB/s")
    print(f"{'op':<8} {'batch':>5} {'context':>7} " + " ".join(f"{b:>16}" for b in sorted({r['backend'] for r in data['rows']})))
    by_point: dict[tuple[str, int, int], dict[str, str]] = {}
    for r in data["rows"]:
        cell = (r["error"] or "ERR")[:16] if r["ms"] is None else f"{r['ms']:.3f}ms {r['of_copy']:.0%}"
        by_point.setdefault((r["op"], r["batch"], r["context"]), {})[r["backend"]] = cell
    backends = sorted({r["backend"] for r in data["rows"]})
    for (op, batch, context), cells in by_point.items():
        print(f"{op:<8} {batch:>5} {context:>7} " + " ".join(f"{cells.get(b, '-'):>16}" for b in backends))
tp_report = out / "tp.json"
if tp_report.exists():
    report = json.loads(tp_report.read_text())
    tp = report["tensor_parallel"]
    one, split = report["results"][0], report["results"][-1]
    print(f"\ntensor parallel over {tp['size']} GPUs: {one['output_tok_s']:.0f} -> {split['output_tok_s']:.0f} output "
          f"tok/s ({tp['speedup_over_tp1']:.2f}x), {tp['collective_ms_per_step']:.2f} ms per step in collectives, "
          f"same tokens as TP=1: {split['same_tokens']:.0%}")
print(f"\ntests: {'OK' if tests_rc == 0 else f'FAILED (pytest exit {tests_rc})'}; "
      f"benchmark: {'OK' if bench_rc == 0 else f'FAILED (exit {bench_rc})'}; "
      f"tensor parallel: {'OK' if tp_rc == 0 else f'FAILED (exit {tp_rc})'}")
PYEOF

[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$tp_rc" -eq 0 ]
