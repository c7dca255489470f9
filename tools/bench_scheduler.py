"""Microbenchmark: cost of one scheduler step (schedule() + update_from_output()) in steady-state decode.

    .venv/bin/python tools/bench_scheduler.py            # 64, 256 and 1,024 running requests
    .venv/bin/python tools/bench_scheduler.py --quick    # a few seconds

Each size runs N requests over the real BlockManager (block size 16, prefix caching on) until every one is
decoding, then times `--steps` steps: one token per request per step, so every step appends a slot, crosses a
block boundary for one request in 16, and builds N ScheduledRequests. The model's work is not included; the
sampled-token mapping is built outside the timed region. Times are CPU time of this process
(`time.process_time`), so a machine shared with other jobs does not inflate them; the wall-clock step time is
shown beside. Target: <= 1 ms per step at 256 running requests.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagoda.blockalloc import BlockManager
from pagoda.scheduler import Request, Scheduler, SchedulerConfig
from pagoda.scheduler.testing import SimSamplingParams
from tqdm import tqdm

PROMPT_LEN = 64
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Row:
    """Timings of one batch size, in microseconds per step (median over the timed steps)."""

    num_running: int
    schedule_us: float
    update_us: float
    wall_us: float  # wall-clock schedule + update

    @property
    def total_us(self) -> float:
        """schedule + update."""
        return self.schedule_us + self.update_us


def setup(num_running: int, steps: int) -> Scheduler:
    """A scheduler with `num_running` requests, all past their prompt."""
    max_len = PROMPT_LEN + 2 * steps + 16
    kv = BlockManager(num_running * (-(-max_len // BLOCK_SIZE) + 1), BLOCK_SIZE)
    config = SchedulerConfig(
        max_num_seqs=num_running, max_num_batched_tokens=max(8192, num_running), max_model_len=max_len
    )
    sched = Scheduler(config, kv)
    for i in range(num_running):
        prompt = [(i * 7919 + j) % 32_000 for j in range(PROMPT_LEN)]
        sched.add_request(Request(f"r{i}", prompt, SimSamplingParams(max_tokens=max_len - PROMPT_LEN)))
    while any(r.num_output_tokens == 0 for r in sched.running) or sched.waiting:
        out = sched.schedule()
        sched.update_from_output(out, {sid: [1] for c in out.scheduled for sid in c.sample_ids})
    return sched


def measure(num_running: int, steps: int, progress: Callable[[int], object]) -> Row:
    """Median microseconds of schedule() and update_from_output() over `steps` decode steps."""
    sched = setup(num_running, steps)
    schedule_s, update_s, wall_s = [], [], []
    cpu, wall = time.process_time, time.perf_counter
    for step in range(steps):
        w0, t0 = wall(), cpu()
        out = sched.schedule()
        t1, w1 = cpu(), wall()
        sampled = {sid: [step % 100 + 1] for chunk in out.scheduled for sid in chunk.sample_ids}
        w2, t2 = wall(), cpu()
        sched.update_from_output(out, sampled)
        t3, w3 = cpu(), wall()
        if len(out.scheduled) != num_running:
            raise RuntimeError(f"expected {num_running} decodes, got {len(out.scheduled)}")
        schedule_s.append(t1 - t0)
        update_s.append(t3 - t2)
        wall_s.append(w1 - w0 + w3 - w2)
        progress(1)
    med = statistics.median
    return Row(num_running, med(schedule_s) * 1e6, med(update_s) * 1e6, med(wall_s) * 1e6)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, time every size and print the table."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024], help="running requests")
    parser.add_argument("--steps", type=int, help="timed steps per size (default 200; 30 with --quick)")
    args = parser.parse_args(argv)
    steps = args.steps or (30 if args.quick else 200)
    rows = []
    with tqdm(total=steps * len(args.sizes), desc="bench_scheduler", unit="step", file=sys.stderr) as bar:
        for size in args.sizes:
            bar.set_postfix_str(f"{size} running")
            rows.append(measure(size, steps, bar.update))
    print(
        f"\nsteady-state decode, BlockManager block size {BLOCK_SIZE}, {steps} timed steps, median CPU time"
    )
    header = (
        f"{'running':>8}{'schedule us':>13}{'update us':>11}{'step us':>10}{'us/request':>12}{'wall us':>10}"
    )
    print(header + "  target <= 1 ms @ 256")
    for r in rows:
        verdict = ("ok" if r.total_us <= 1000 else "over") if r.num_running == 256 else ""
        print(
            f"{r.num_running:>8}{r.schedule_us:>13.0f}{r.update_us:>11.0f}{r.total_us:>10.0f}"
            f"{r.total_us / r.num_running:>12.2f}{r.wall_us:>10.0f}  {verdict}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
