"""What a dashboard frame costs the engine: the engine-thread snapshot against the engine's own step time.

    .venv/bin/python tools/bench_dashboard.py            # 16,384 blocks, 256 running sequences
    .venv/bin/python tools/bench_dashboard.py --quick

Part 1, the allocator and scheduler alone: a pool of `--num-blocks` blocks filled by `--num-seqs` running
sequences (a shared 256-token system prompt, every 4th request with n = 2), then the engine-thread part of a
frame (`BlockManager.snapshot` + `Scheduler.queue_view`) and the off-thread part (encode + JSON), median of
`--repeat` runs. Part 2, a real engine (the tiny random Llama of pagoda.server.testing, float32) with the same
pool size and `--num-seqs` requests decoding: its mean step time, and the whole engine-thread snapshot of that engine (with full latency windows). The frame
share is the snapshot's time per second of engine time at 4 frames a second (what the engine thread gives up),
and the snapshot over one step. `--sliding-groups K` gives part 1's allocator one full-attention KV cache group and
K sliding-window groups of `--window` tokens (gemma3's layout: 1 + 5 groups of window 512), so that the frame
carries one map per group; `--allocator-only` skips part 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from pagoda.blockalloc import FULL_ATTENTION, BlockManager, KVCacheGroupSpec
from pagoda.scheduler import Request, Scheduler, SchedulerConfig
from pagoda.scheduler.testing.sim import SimSamplingParams
from pagoda.server.dashboard.encoder import encode_replica
from pagoda.server.dashboard.snapshot import ReplicaSnapshot, take_snapshot
from pagoda.server.metrics import ServerMetrics
from pagoda.server.outputs import EngineStats

FPS = 4.0


def median_seconds(fn: Callable[[], object], repeat: int) -> float:
    """Median wall time of `fn` over `repeat` calls."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def allocator_part(
    num_blocks: int, num_seqs: int, repeat: int, sliding_groups: int = 0, window: int = 512
) -> None:
    """Snapshot and encode times over a full pool driven by the real scheduler (with `sliding_groups` window
    groups beside the full one: as many sequences run as the pool takes)."""
    block_size = 16
    # Prompts that fill ~all blocks: a shared 16-block system prompt, then each sequence's own blocks.
    prompt_len = 256 + (num_blocks - 16 - num_seqs) * block_size // num_seqs - block_size
    config = SchedulerConfig(
        max_num_seqs=2 * num_seqs,
        max_model_len=prompt_len + 64,
        max_num_batched_tokens=num_blocks * block_size,
    )
    groups = (FULL_ATTENTION, *[KVCacheGroupSpec(sliding_window=window)] * sliding_groups)
    kv = BlockManager(num_blocks, block_size, num_host_blocks=1024, groups=groups)
    sched = Scheduler(config, kv)
    system = list(range(1, 257))
    for i in range(num_seqs):
        prompt = system + [1000 + i * 7 + j for j in range(prompt_len - len(system))]
        sched.add_request(
            Request(f"req-{i}", prompt, SimSamplingParams(max_tokens=32, n=2 if i % 4 == 0 else 1))
        )
    out = sched.schedule()
    chunks = {c.request_id: c.num_tokens for c in out.scheduled}
    stats = EngineStats(
        len(sched.running), len(sched.waiting), 0, kv.stats().usage, num_blocks, block_size, 0, 0, 0, 0, 0
    )

    def snapshot() -> ReplicaSnapshot:
        return ReplicaSnapshot(0, kv.snapshot(), sched.queue_view(chunks), stats)

    snap = snapshot()
    used = num_blocks - kv.num_free_blocks()
    take = median_seconds(snapshot, repeat)
    encode = median_seconds(lambda: json.dumps(encode_replica(snap)), repeat)
    size = len(json.dumps(encode_replica(snap), separators=(",", ":")))
    kinds = f", groups: 1 full + {sliding_groups} x window {window}" if sliding_groups else ""
    print(f"allocator: {num_blocks} blocks ({used} used), {len(sched.running)} running sequences{kinds}")
    print(f"  engine-thread snapshot: {take * 1e3:.2f} ms   off-thread encode + JSON: {encode * 1e3:.2f} ms")
    print(f"  frame: {size / 1024:.1f} KiB of JSON")


def engine_part(num_blocks: int, num_seqs: int, steps: int, repeat: int) -> None:
    """A real engine's decode step time against the snapshot of the same engine."""
    from pagoda.server.engine import LLMEngine
    from pagoda.server.llm import LLM
    from pagoda.server.sampling_params import SamplingParams
    from pagoda.server.testing import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model("llama", Path(tmp) / "llama", max_position_embeddings=4096)
        llm = LLM(
            str(model),
            num_kv_blocks=num_blocks,
            max_num_seqs=num_seqs,
            max_model_len=2048,
            dtype="float32",
            max_num_batched_tokens=8192,
        )
        engine: LLMEngine = llm.engine
        params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0)
        # Prompts that fill ~90% of the pool, as a loaded server's would.
        prompt_len = min(1900, int(0.9 * num_blocks * 16 / num_seqs))
        for i in range(num_seqs):
            engine.add_request(f"r{i}", [(i * 13 + j) % 200 + 5 for j in range(prompt_len)], params)
        while engine.get_stats().num_running < num_seqs or engine.scheduler.waiting:
            engine.step()
        for _ in range(3):
            engine.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        step = (time.perf_counter() - t0) / steps
        metrics = ServerMetrics("bench", engine.get_stats)
        for _ in range(8192):  # full latency windows, as a busy server's
            metrics.ttft_window.add(0.1)
            metrics.itl_window.add(0.01)
        take = median_seconds(lambda: take_snapshot(engine, metrics), repeat)
        used = engine.get_stats().kv_cache_usage
        print(f"engine (tiny llama, float32): {num_blocks} blocks ({used:.0%} used), {num_seqs} running")
        print(f"  mean step: {step * 1e3:.2f} ms   engine-thread snapshot: {take * 1e3:.2f} ms")
        print(f"  snapshot / one step: {take / step:.1%}")
        print(f"  engine-thread share at {FPS:g} frames/s: {take * FPS:.2%} of each second")


def main(argv: list[str] | None = None) -> None:
    """Run both parts and print their numbers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-blocks", type=int, default=16384)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="1,024 blocks, 32 sequences")
    parser.add_argument(
        "--sliding-groups", type=int, default=0, help="part 1: sliding-window KV cache groups"
    )
    parser.add_argument("--window", type=int, default=512, help="their window, in tokens")
    parser.add_argument("--allocator-only", action="store_true", help="skip part 2 (the real engine)")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_blocks, args.num_seqs, args.steps, args.repeat = 1024, 32, 3, 5
    allocator_part(args.num_blocks, args.num_seqs, args.repeat, args.sliding_groups, args.window)
    if not args.allocator_only:
        engine_part(args.num_blocks, args.num_seqs, args.steps, args.repeat)


if __name__ == "__main__":
    main()
