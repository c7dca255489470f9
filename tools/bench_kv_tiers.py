"""KV tiers on a multi-turn chat trace (issue #39): hit rate and TTFT with no tier, a host tier, a disk tier, an
ideal pool, and a restart in the middle.

    .venv/bin/python tools/bench_kv_tiers.py                        # SmolLM2-135M-Instruct, table + PNG
    .venv/bin/python tools/bench_kv_tiers.py --model tiny --conversations 4 --turns 3   # seconds (the smoke test)

The trace: C conversations of T turns, interleaved round robin (conversation 0 turn 1, conversation 1 turn 1, ...),
so that a conversation's history has to outlive the other conversations' traffic. A turn's prompt is the previous
prompt, the previous answer (greedy, `--answer-tokens`) and a new user message (`--user-tokens` random ids); the
first turn starts with a shared system prompt (`--system-tokens`). The working set is every conversation's
longest context; the engine's pool holds `--pool-fraction` of it (a fifth by default), the tiers all of it, the
ideal pool all of it on the device.

Runs, each its own engine (in process: TTFT is the time from adding a request to its first token, requests one
at a time, as a person chatting):
  - none: the small pool only; host: `--kv-offloading-size`; disk: a disk tier (its host tier a staging area of
    `--staging-blocks` blocks); ideal: a pool holding the working set (the hit rate's reference);
  - restart: a disk-tier engine runs the first half of the turns and closes (graceful: its writes finish); a new
    engine on the same folder runs the rest; each conversation's first turn after the restart is compared with
    the same turn on a cold engine (no tier, empty pool).
Hit rate = cached prompt tokens over prompt tokens (`num_cached_tokens`, what `usage.cached_tokens` reports).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pagoda.pagedkernel.cbuild import cpu_name
from pagoda.server.llm import LLM
from pagoda.server.sampling_params import SamplingParams
from tqdm import tqdm

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of the trace: its conversation, turn index and the new user tokens it appends."""

    conversation: int
    turn: int
    user: tuple[int, ...]


@dataclass(slots=True)
class Result:
    """One run: per request (in trace order) its TTFT and hit rate."""

    name: str
    ttft: list[float] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens over prompt tokens."""
        return sum(self.cached) / max(1, sum(self.prompt))

    def p(self, q: float) -> float:
        """The q-quantile of TTFT, in ms."""
        values = sorted(self.ttft)
        return 1000 * values[min(len(values) - 1, int(q * len(values)))]


def make_trace(args: argparse.Namespace) -> tuple[tuple[int, ...], list[Turn]]:
    """The shared system prompt and the turns, interleaved round robin (seeded)."""
    g = torch.Generator().manual_seed(args.seed)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(100, args.vocab, (n,), generator=g).tolist())

    system = ids(args.system_tokens)
    turns = [Turn(c, t, ids(args.user_tokens)) for t in range(args.turns) for c in range(args.conversations)]
    return system, turns


class Conversations:
    """Each conversation's context so far (prompt and answers), grown turn by turn."""

    def __init__(self, system: tuple[int, ...], count: int) -> None:
        self.context = [list(system) for _ in range(count)]

    def prompt(self, turn: Turn) -> list[int]:
        """The prompt of `turn`: the context and the new user message."""
        return [*self.context[turn.conversation], *turn.user]

    def answered(self, turn: Turn, prompt: list[int], answer: Sequence[int]) -> None:
        """The next turn starts from this prompt and its answer."""
        self.context[turn.conversation] = [*prompt, *answer]


def working_set_tokens(args: argparse.Namespace) -> int:
    """Every conversation's longest context: the last turn's prompt and answer."""
    per_conversation = args.system_tokens + args.turns * (args.user_tokens + args.answer_tokens)
    return int(args.conversations * per_conversation)


def run_turns(
    llm: LLM, turns: Sequence[Turn], chats: Conversations, result: Result, bar: tqdm[Any], answer_tokens: int
) -> None:
    """Send `turns` one at a time; record TTFT and cached tokens."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=answer_tokens, ignore_eos=True)
    for turn in turns:
        prompt = chats.prompt(turn)
        rid = f"c{turn.conversation}t{turn.turn}-{result.name}-{len(result.ttft)}"
        start = time.perf_counter()
        engine.add_request(rid, prompt, params)
        first: float | None = None
        answer: list[int] = []
        cached = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id != rid:
                    continue
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter() - start
                cached = out.num_cached_tokens
                answer = list(out.outputs[0].token_ids)
        assert first is not None
        result.ttft.append(first)
        result.cached.append(cached)
        result.prompt.append(len(prompt))
        chats.answered(turn, prompt, answer)
        bar.update(1)


def engine_args(args: argparse.Namespace, blocks: int, **extra: Any) -> dict[str, Any]:
    """The LLM arguments of a run with a pool of `blocks` blocks."""
    base: dict[str, Any] = {
        "block_size": args.block_size,
        "num_kv_blocks": blocks,
        "max_model_len": working_set_tokens(args) // args.conversations + 64,
        "max_num_seqs": 4,
    }
    if args.dtype:
        base["dtype"] = args.dtype
    base.update(extra)
    return base


def model_path(args: argparse.Namespace, scratch: Path) -> str:
    """The model: a name or path, or `tiny` (the tests' tiny Llama, built here)."""
    if args.model != "tiny":
        return str(args.model)
    from pagoda.server.testing import make_tiny_model

    return str(make_tiny_model("llama", scratch / "tiny", max_position_embeddings=8192))


def tier_bytes(llm: LLM, tokens: int) -> float:
    """GiB that hold `tokens` tokens of this engine's KV (with room for the sets' unevenness)."""
    shape = llm.engine.runner.kv_cache.shape
    blocks = -(-tokens // shape.block_size)
    return 2.0 * blocks * shape.bytes_per_block * len(shape.layout.groups if shape.layout else (0,)) / GIB


def main(argv: list[str] | None = None) -> int:
    """Run every configuration, print the table, write the PNG."""
    args = parse_args(argv)
    if args.model == "tiny":
        args.vocab = min(args.vocab, 300)
    scratch = Path(tempfile.mkdtemp(prefix="bench-kv-tiers-"))
    model = model_path(args, scratch)
    system, turns = make_trace(args)
    ws = working_set_tokens(args)
    small = max(
        -(-ws // args.block_size) // int(1 / args.pool_fraction),
        -(-ws // args.conversations // args.block_size) + 4,
    )
    big = -(-ws // args.block_size) + 64
    half = len(turns) // 2
    bar = tqdm(
        total=len(turns) * 5 + (len(turns) - half) + args.conversations,
        desc="bench_kv_tiers",
        file=sys.stderr,
    )
    results: list[Result] = []
    probe = LLM(model, **engine_args(args, small))
    gib = tier_bytes(probe, ws)
    probe.engine.close()
    del probe
    configs: list[tuple[str, dict[str, Any]]] = [
        ("none", engine_args(args, small)),
        ("host tier", engine_args(args, small, kv_offloading_size=gib)),
        (
            "disk tier",
            engine_args(
                args,
                small,
                kv_offloading_size=gib * args.staging_fraction,
                kv_offloading_disk_path=str(scratch / "disk-run"),
                kv_offloading_disk_size=2 * gib,
            ),
        ),
        ("ideal (pool holds all)", engine_args(args, big)),
    ]
    for name, kwargs in configs:
        llm = LLM(model, **kwargs)
        result = Result(name)
        run_turns(llm, turns, Conversations(system, args.conversations), result, bar, args.answer_tokens)
        llm.engine.close()
        results.append(result)
    # Restart: the first half on a disk-tier engine, then a new engine on the same folder.
    folder = scratch / "disk-restart"
    disk_kwargs = engine_args(
        args,
        small,
        kv_offloading_size=gib * args.staging_fraction,
        kv_offloading_disk_path=str(folder),
        kv_offloading_disk_size=2 * gib,
    )
    chats = Conversations(system, args.conversations)
    before = Result("restart: before")
    llm = LLM(model, **disk_kwargs)
    run_turns(llm, turns[:half], chats, before, bar, args.answer_tokens)
    llm.engine.close()
    cold_chats = Conversations(system, args.conversations)
    cold_chats.context = [list(c) for c in chats.context]
    after = Result("restart: after (disk)")
    llm = LLM(model, **disk_kwargs)
    run_turns(llm, turns[half:], chats, after, bar, args.answer_tokens)
    llm.engine.close()
    cold = Result("restart: cold")
    llm = LLM(model, **engine_args(args, small))
    run_turns(llm, turns[half : half + args.conversations], cold_chats, cold, bar, args.answer_tokens)
    llm.engine.close()
    bar.close()
    first_after = after.ttft[: args.conversations]
    print(table(args, results, first_after, cold.ttft, after, model))
    if args.png:
        plot(results, Path(args.png))
        print(f"plot: {args.png}")
    return 0


def table(
    args: argparse.Namespace,
    results: list[Result],
    first_after: list[float],
    cold: list[float],
    after: Result,
    model: str,
) -> str:
    """The markdown table."""
    none = next(r for r in results if r.name == "none")
    ideal = next(r for r in results if r.name.startswith("ideal"))
    lines = [
        f"KV tiers on a multi-turn trace: {args.conversations} conversations x {args.turns} turns, model {Path(model).name}, "
        f"CPU {cpu_name()}; pool {args.pool_fraction:g} of the working set ({working_set_tokens(args)} tokens)",
        "",
        "| run | hit rate | of ideal | TTFT p50 (ms) | TTFT p99 (ms) | p50 vs none |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r.name} | {r.hit_rate:.3f} | {r.hit_rate / max(ideal.hit_rate, 1e-9):.2f} | {r.p(0.5):.0f} | "
            f"{r.p(0.99):.0f} | {r.p(0.5) / none.p(0.5):.2f}x |"
        )
    ratio = statistics.median(cold) / statistics.median(first_after)
    lines += [
        "",
        f"Restart with the disk tier: first turn of each conversation after the restart TTFT median "
        f"{1000 * statistics.median(first_after):.0f} ms (hit rate {sum(after.cached[: args.conversations]) / max(1, sum(after.prompt[: args.conversations])):.2f}) "
        f"vs a cold engine {1000 * statistics.median(cold):.0f} ms: {ratio:.2f}x faster",
    ]
    return "\n".join(lines)


def plot(results: list[Result], path: Path) -> None:
    """Hit rate (cumulative) and TTFT per request, per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for r in results:
        cum = [sum(r.cached[: i + 1]) / sum(r.prompt[: i + 1]) for i in range(len(r.cached))]
        top.plot(cum, label=r.name)
        bottom.plot([1000 * t for t in r.ttft], label=r.name)
    top.set_ylabel("hit rate (cumulative)")
    bottom.set_ylabel("TTFT (ms)")
    bottom.set_xlabel("request (trace order)")
    top.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The benchmark's options."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model name or path, or `tiny`")
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=256)
    parser.add_argument("--user-tokens", type=int, default=128)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--pool-fraction", type=float, default=0.2, help="the pool's share of the working set"
    )
    parser.add_argument(
        "--staging-fraction", type=float, default=0.25, help="the disk runs' host tier's share"
    )
    parser.add_argument("--vocab", type=int, default=40000, help="user tokens are drawn from [100, vocab)")
    parser.add_argument("--dtype", default=None, help="the engine's dtype (default: auto)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--png", default=None, help="write the plot here")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
