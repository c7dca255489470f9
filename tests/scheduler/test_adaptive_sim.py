"""The adaptive policy against the fixed profiles on the simulated phased trace (`slo_sim`: the real scheduler on
a fake machine with a 2-core CPU's step costs): goodput, requests meeting both objectives."""

from __future__ import annotations

import pytest
from pagoda.blockalloc import BlockManager
from pagoda.scheduler.config import SchedulingProfileName
from pagoda.scheduler.testing.slo_sim import CPU_COSTS, NATIVE_CPU_COSTS, PHASES, phased_trace, simulate

FIXED: tuple[SchedulingProfileName, ...] = ("throughput", "latency", "balanced")


def block_manager(num_blocks: int, block_size: int, enable_prefix_caching: bool) -> BlockManager:
    """The allocator of each simulated run."""
    return BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)


def goodput(
    profile: SchedulingProfileName | None,
    chat_rate: float,
    costs: tuple[float, float, float, float] = CPU_COSTS,
) -> dict[str, int]:
    """Requests meeting both objectives per phase, and over the trace ("all"), on the machine of `costs`."""
    result = simulate(profile, phased_trace(0, 20.0, chat_rate), block_manager, costs=costs)
    met = {phase: result[phase].met for phase in PHASES}
    return {**met, "all": sum(met.values())}


@pytest.mark.parametrize(("chat_rate", "ratio"), [(8.0, 1.8), (10.0, 2.5)])
def test_under_a_chatty_overload_adaptive_keeps_the_streams_it_admits(chat_rate: float, ratio: float) -> None:
    """Chats at 8 and 10/s, past what the machine decodes within 150 ms a token: the fixed profiles admit every
    chat and most miss TPOT or TTFT (the latency profile's 32 seats do best); adaptive sheds the chats whose TTFT
    is lost instead of slowing every stream, plans with headroom and serves the long-lost ones one at a time.
    (Without the headroom and that lane it met 141 and 81 requests, 1.52x and 1.45x the best fixed profile; with
    them 196 and 212, 2.11x and 3.79x.)"""
    adaptive = goodput("adaptive", chat_rate)
    best = max(goodput(profile, chat_rate)["all"] for profile in FIXED)
    assert adaptive["all"] >= ratio * best, (adaptive, best)
    assert adaptive["all"] >= 3 * goodput(None, chat_rate)["all"]


@pytest.mark.parametrize("chat_rate", [2.0, 6.0])
def test_below_the_overload_adaptive_is_not_worse_than_a_fixed_profile(chat_rate: float) -> None:
    """Where every profile serves the chats, adaptive stays within 5% of the best fixed profile in every phase
    (the issue's per-phase target) and over the trace."""
    adaptive = goodput("adaptive", chat_rate)
    fixed = [goodput(profile, chat_rate) for profile in FIXED]
    for key in (*PHASES, "all"):
        assert adaptive[key] >= 0.95 * max(f[key] for f in fixed), (key, adaptive, fixed)


@pytest.mark.parametrize(("chat_rate", "ratio"), [(30.0, 1.3), (40.0, 1.5)])
def test_on_the_native_decode_machine_the_overload_moves_and_adaptive_still_leads(
    chat_rate: float, ratio: float
) -> None:
    """The same CPU once its decode steps run in one native call (`NATIVE_CPU_COSTS`, ~3x the capacity): at 30 and
    40 chats/s the fixed profiles miss most chats (the best met 577 and 590 of ~920 and ~1,260) and adaptive met
    837 and 976 (1.45x, 1.65x); every phase at least 0.95x the best fixed profile's."""
    adaptive = goodput("adaptive", chat_rate, NATIVE_CPU_COSTS)
    fixed = [goodput(profile, chat_rate, NATIVE_CPU_COSTS) for profile in FIXED]
    assert adaptive["all"] >= ratio * max(f["all"] for f in fixed), (adaptive, fixed)
    for phase in PHASES:
        assert adaptive[phase] >= 0.95 * max(f[phase] for f in fixed), (phase, adaptive, fixed)
