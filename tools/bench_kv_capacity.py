"""KV capacity with and without KV cache groups (the hybrid KV cache manager), and with int8 KV: long prompts at a
fixed KV size.

    .venv/bin/python tools/bench_kv_capacity.py                    # Gemma 3 270M, simulator only: table + PNG
    .venv/bin/python tools/bench_kv_capacity.py --engine --kv-cache-gib 0.05 --prompt-len 1024 --num-prompts 8

For hybrid off (one block table for every layer), on (one group per attention type, sliding-window groups
keeping only their window) and on + int8 (the same groups, `--kv-cache-dtype int8`), at the same `--kv-cache-gib`:
  - the simulator's prediction: the real `Scheduler` and `BlockManager` (with the model's groups) run the
    workload with a stand-in model, and report how many sequences decode at once, beside the steady bound (the
    pool over what one prefilled prompt holds: what a prefill peak costs shows as the gap);
  - with `--engine`, the real engine on the model: sequences decoding at once, output tokens/s over the
    makespan, and TPOT (the mean time of a step in which every running sequence decodes);
  - the KV cost of one sequence at each of `--lengths`, in bytes per token, from the model's layout.
The capacity numbers depend on the layout only, not on the machine; the timings are of this (shared) machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from pagoda.blockalloc import BlockManager
from pagoda.scheduler import Request, Scheduler, SchedulerConfig
from pagoda.scheduler.testing import SimSamplingParams
from pagoda.server.config import EngineConfig
from pagoda.server.engine.kv_cache import KVCacheShape
from pagoda.server.engine.kv_groups import KVCacheLayout, plan_kv_cache_layout
from pagoda.server.loader import resolve_model_folder
from pagoda.server.models.layers import head_dim_of
from pagoda.server.models.llama import layer_sliding_windows
from transformers import AutoConfig


@dataclass(frozen=True, slots=True)
class Setup:
    """One configuration measured: the hybrid KV cache manager on or off, and the KV cache dtype."""

    hybrid: bool
    kv_cache_dtype: str  # "auto" (the model's bfloat16) or "int8"

    @property
    def name(self) -> str:
        """As the table and plot label it."""
        return f"hybrid {'on' if self.hybrid else 'off'}" + (
            " + int8" if self.kv_cache_dtype == "int8" else ""
        )


SETUPS = (Setup(False, "auto"), Setup(True, "auto"), Setup(True, "int8"))


@dataclass(frozen=True, slots=True)
class Geometry:
    """What a model's KV cache costs: its layer windows and its KV heads' shape."""

    windows: tuple[int | None, ...]
    num_kv_heads: int
    head_dim: int

    def layout(self, hybrid: bool) -> KVCacheLayout:
        """The engine's layout for this model."""
        return plan_kv_cache_layout(self.windows, hybrid=hybrid)

    def block_bytes(self, layout: KVCacheLayout, block_size: int, kv_cache_dtype: str = "auto") -> int:
        """Bytes of one block of the layout (its layers_per_group layers), as the engine sizes it (int8: with
        its scales)."""
        cache_dtype = torch.int8 if kv_cache_dtype == "int8" else None
        shape = KVCacheShape(
            layout.layers_per_group, self.num_kv_heads, self.head_dim, block_size, torch.bfloat16, cache_dtype
        )
        return shape.bytes_per_block


def geometry(model: str | None) -> Geometry:
    """The model's layer windows and KV heads, from its config alone."""
    config = AutoConfig.from_pretrained(resolve_model_folder(model)).get_text_config()
    kv_heads = int(getattr(config, "num_key_value_heads", config.num_attention_heads))
    return Geometry(tuple(layer_sliding_windows(config)), kv_heads, head_dim_of(config))


@dataclass(frozen=True, slots=True)
class Row:
    """One configuration's numbers (None: not measured)."""

    setup: Setup
    num_blocks: int
    # The pool over one prompt's blocks after its prefill (no chunk peak): a decoding sequence holds at least
    # that, so no more than this many decode at once.
    steady_bound: float
    predicted_at_once: int
    measured_at_once: int | None = None
    output_tok_s: float | None = None
    tpot_ms: float | None = None


def simulate(layout: KVCacheLayout, num_blocks: int, args: argparse.Namespace) -> int:
    """Most sequences decoding in one step when the real scheduler runs the workload on this pool."""
    kv = BlockManager(num_blocks, args.block_size, groups=layout.groups, enable_prefix_caching=False)
    max_len = args.prompt_len + args.max_tokens
    config = SchedulerConfig(
        max_num_seqs=args.num_prompts,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_len,
    )
    scheduler = Scheduler(config, kv)
    for i in range(args.num_prompts):
        prompt = tuple(range(i * max_len, i * max_len + args.prompt_len))  # distinct: no prefix sharing
        scheduler.add_request(
            Request(f"r{i}", prompt, SimSamplingParams(max_tokens=args.max_tokens), arrival_time=float(i))
        )
    most = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        most = max(most, sum(1 for c in out.scheduled if c.num_tokens == 1))
        scheduler.update_from_output(out, {sid: [7] for c in out.scheduled for sid in c.sample_ids})
    return most


def run_engine(args: argparse.Namespace, setup: Setup) -> tuple[int, float, float]:
    """(sequences decoding at once, output tokens/s, TPOT in ms) of the real engine on the workload."""
    from pagoda.server.engine import LLMEngine
    from pagoda.server.sampling_params import SamplingParams

    config = EngineConfig.from_flat(
        model=args.model,
        kv_cache_gib=args.kv_cache_gib,
        block_size=args.block_size,
        max_model_len=args.prompt_len + args.max_tokens,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.num_prompts,
        enable_prefix_caching=False,
        disable_hybrid_kv_cache_manager=not setup.hybrid,
        kv_cache_dtype=setup.kv_cache_dtype,
    )
    engine = LLMEngine.from_config(config)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    span = min(20_000, engine.vocab_size - 10)  # distinct ids a prompt cycles through (a tiny model has few)
    for i in range(args.num_prompts):
        engine.add_request(
            f"r{i}", [(7 + 31 * i + 17 * p) % span + 10 for p in range(args.prompt_len)], params
        )
    most, produced, decode_times = 0, 0, []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outputs = engine.step()
        running = engine.scheduler.running
        if running and all(r.num_computed_tokens == r.num_tokens - 1 for r in running):
            decode_times.append(time.perf_counter() - t0)
        most = max(most, len(running))
        produced += sum(1 for o in outputs if not o.finished)
    makespan = time.perf_counter() - start
    produced = args.num_prompts * args.max_tokens
    tpot = 1e3 * sum(decode_times) / len(decode_times) if decode_times else float("nan")
    return most, produced / makespan, tpot


def cost_table(geo: Geometry, lengths: Sequence[int], block_size: int) -> list[tuple[int, list[float]]]:
    """Per length: KV bytes per token of one decoding sequence in each of SETUPS."""
    rows = []
    for n in lengths:
        per = []
        for setup in SETUPS:
            layout = geo.layout(setup.hybrid)
            blocks = layout.blocks_for_tokens(n, block_size, 1)
            per.append(blocks * geo.block_bytes(layout, block_size, setup.kv_cache_dtype) / n)
        rows.append((n, per))
    return rows


def plot(rows: Sequence[Row], costs: Sequence[tuple[int, list[float]]], path: Path) -> None:
    """Sequences at once (predicted and measured) and KV bytes per token against length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r.setup.name for r in rows]
    left.bar([i - 0.2 for i in range(len(rows))], [r.predicted_at_once for r in rows], 0.4, label="simulator")
    measured = [r.measured_at_once or 0 for r in rows]
    if any(measured):
        left.bar([i + 0.2 for i in range(len(rows))], measured, 0.4, label="engine")
    left.set_xticks(range(len(rows)), names)
    left.set_ylabel("sequences decoding at once")
    left.legend()
    for i, setup in enumerate(SETUPS):
        right.plot([c[0] for c in costs], [c[1][i] / 1024 for c in costs], marker="o", label=setup.name)
    right.set_xscale("log", base=2)
    right.set_xlabel("sequence length (tokens)")
    right.set_ylabel("KV KiB per token")
    right.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, measure, print the tables, write the PNG."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m", help="a model folder, .gguf or packaged short name")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--prompt-len", type=int, default=6144)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--engine", action="store_true", help="also run the real engine (slow on a CPU)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--out", type=Path, default=Path("out/bench_kv_capacity.png"))
    args = parser.parse_args(argv)
    geo = geometry(args.model)
    rows = []
    for setup in SETUPS:
        layout = geo.layout(setup.hybrid)
        block_bytes = geo.block_bytes(layout, args.block_size, setup.kv_cache_dtype)
        num_blocks = int(args.kv_cache_gib * 2**30 // block_bytes)
        steady = layout.blocks_for_tokens(args.prompt_len, args.block_size, 1)
        row = Row(setup, num_blocks, num_blocks / steady, simulate(layout, num_blocks, args))
        if args.engine:
            most, tok_s, tpot = run_engine(args, setup)
            row = Row(setup, num_blocks, row.steady_bound, row.predicted_at_once, most, tok_s, tpot)
        rows.append(row)
        print(f"{setup.name}: {layout.describe()}", file=sys.stderr)
    print(
        f"{args.num_prompts} prompts of {args.prompt_len} tokens + {args.max_tokens} out, "
        f"--kv-cache-gib {args.kv_cache_gib}, block size {args.block_size}"
    )
    print(
        "| configuration | blocks | steady bound | at once (simulator) | vs off | at once (engine) | output tok/s "
        "| TPOT ms |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    off_at_once = rows[0].predicted_at_once
    for r in rows:
        print(
            f"| {r.setup.name} | {r.num_blocks} | {r.steady_bound:.2f} | {r.predicted_at_once} | "
            f"{r.predicted_at_once / max(off_at_once, 1):.1f}x | "
            f"{fmt(r.measured_at_once, 'd')} | {fmt(r.output_tok_s, '.1f')} | {fmt(r.tpot_ms, '.1f')} |"
        )
    costs = cost_table(geo, args.lengths, args.block_size)
    print(
        "\n| length | KV per token, hybrid off | hybrid on | hybrid on + int8 | ratio on | ratio on + int8 |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for n, (off, on, on_int8) in costs:
        print(
            f"| {n} | {off / 1024:.1f} KiB | {on / 1024:.2f} KiB | {on_int8 / 1024:.2f} KiB | {off / on:.2f}x | "
            f"{off / on_int8:.2f}x |"
        )
    plot(rows, costs, args.out)
    print(f"\nplot: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
