"""The scheduling profiles on the phased trace, simulated (`pagoda.scheduler.testing.slo_sim`): the real
scheduler and policies on a fake machine with a 2-core CPU's step costs, per chat rate; requests meeting both
objectives per phase, and adaptive against the best fixed profile and the default. Seconds, not the quarter hour
a server run takes (`tools/bench_adaptive.py`), so a policy change can be judged on overloads first.

    .venv/bin/python tools/simulate_adaptive.py                       # chat rates 2, 4, 6, 8, 10 requests/s
    .venv/bin/python tools/simulate_adaptive.py --chat-rates 8 --phase-seconds 60
    .venv/bin/python tools/simulate_adaptive.py --machine native --chat-rates 20 25 30 40
"""

from __future__ import annotations

import argparse

from pagoda.blockalloc import BlockManager
from pagoda.scheduler.config import SchedulingProfileName
from pagoda.scheduler.testing.slo_sim import MACHINES, PHASES, phased_trace, simulate
from tqdm import tqdm

PROFILES: tuple[SchedulingProfileName | None, ...] = (None, "throughput", "latency", "balanced", "adaptive")


def block_manager(num_blocks: int, block_size: int, enable_prefix_caching: bool) -> BlockManager:
    """The allocator of each simulated run."""
    return BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)


def main(argv: list[str] | None = None) -> list[str]:
    """Print (and return) one table row per chat rate and profile."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chat-rates", type=float, nargs="+", default=[2.0, 4.0, 6.0, 8.0, 10.0])
    parser.add_argument("--phase-seconds", type=float, default=20.0)
    parser.add_argument("--document-rate", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--machine",
        choices=sorted(MACHINES),
        default="modules",
        help="the step costs: the 2-core CPU's decode steps module by module, or in one native call (slo_sim)",
    )
    args = parser.parse_args(argv)
    if min(args.chat_rates) <= 0 or args.phase_seconds <= 0 or args.document_rate <= 0:
        parser.error("--chat-rates, --phase-seconds and --document-rate must be > 0")
    costs = MACHINES[args.machine]
    a, b, c, d = costs
    rows = [
        f"fake machine: {a * 1e3:g} ms + {b * 1e3:g} ms a decode row + {c * 1e3:g} ms a prefill token + "
        f"{d * 1e3:g} ms per 1,000 context tokens; TTFT <= 2.5 s, TPOT <= 150 ms; phases of {args.phase_seconds:g} s",
        "chat/s | profile | " + " | ".join(PHASES) + " | all | vs best fixed | vs default",
    ]
    runs = [(rate, profile) for rate in args.chat_rates for profile in PROFILES]
    met: dict[tuple[float, SchedulingProfileName | None], int] = {}
    for rate, profile in tqdm(runs, desc="simulating", unit="run"):
        result = simulate(
            profile,
            phased_trace(args.seed, args.phase_seconds, rate, args.document_rate),
            block_manager,
            costs=costs,
        )
        met[rate, profile] = sum(r.met for r in result.values())
        best = max((met.get((rate, p), 0) for p in ("throughput", "latency", "balanced")), default=0)
        ratios = ""
        if profile == "adaptive":
            ratios = f" | {met[rate, profile] / max(best, 1):.2f}x | {met[rate, profile] / max(met[rate, None], 1):.2f}x"
        cells = " | ".join(f"{r.met}/{r.requests}" for r in result.values())
        rows.append(f"{rate:g} | {profile or 'default'} | {cells} | {met[rate, profile]}{ratios}")
    print("\n".join(rows))
    return rows


if __name__ == "__main__":
    main()
