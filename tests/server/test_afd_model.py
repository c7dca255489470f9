"""The AFD cost model (pagoda.server.bench.afd_model): hand-computed layer times and steps of the built head split
and of the data-parallel alternative, the ping-pong closed form against the schedule, where AFD cannot pay or
cannot hold the KV, the break-even batch against link bandwidth, the fits; the calibration's measurements at tiny
sizes, its gloo exchange between two real processes on loopback, and tools/simulate.py --afd."""

from __future__ import annotations

import math
import random
import re

import pytest
from pagoda.server.bench import afd_calibrate
from pagoda.server.bench.afd_model import (
    GEMMA3_270M,
    H100_LIKE,
    LLAMA_8B,
    MODELS,
    AfdShape,
    Device,
    Link,
    ModelConfig,
    all_reduce_time,
    attention_time,
    attn_shard_bytes,
    attn_weight_bytes,
    batch_grid,
    break_even_batch,
    colocated,
    disaggregated,
    disaggregated_at,
    fit_device,
    fit_link,
    kv_bytes_per_seq,
    kv_bytes_per_token,
    kv_share,
    kv_tokens_per_layer,
    link_time,
    min_attn_workers,
    mlp_time,
    mlp_weight_bytes,
    pingpong_reference,
    pingpong_step,
    speedup,
    splits_over,
)
from tool_scripts import load_tool

TOY = ModelConfig("toy", hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16)
# Memory-bound toy device: 1 MB/s for weights and KV, compute for free, 1 ms per layer side, 1 GB.
SLOW = Device("slow", 1e6, 1e6, 1e18, 1e-3, 1e9)
CPU_LIKE = Device("cpu-like", 5e9, 3e9, 150e9, 25e-6, 20 * 2**30)
SEQUENCES = AfdShape(attention="sequences")  # data-parallel attention, the alternative not built


def test_layer_bytes_by_hand() -> None:
    """q/k/v/o, gate/up/down and one token's K and V of the toy config, counted by hand."""
    assert attn_weight_bytes(TOY) == (2 * 64 * 64 + 2 * 64 * 32) * 2 == 24576
    assert mlp_weight_bytes(TOY) == 3 * 64 * 128 * 2 == 49152
    assert kv_bytes_per_token(TOY) == 2 * 2 * 16 * 2 == 128
    assert kv_bytes_per_seq(TOY, 10) == 10 * 2 * 128


def test_head_shards_by_hand() -> None:
    """The toy's 4 query and 2 KV heads over 2 workers: half of every projection and of the KV; over 4: a quarter
    of q and o, but each worker keeps one whole KV head (its k and v, half the KV); 3 do not split 4 heads."""
    assert attn_shard_bytes(TOY, 1) == attn_weight_bytes(TOY)
    assert attn_shard_bytes(TOY, 2) == (2 * 64 * 64 / 2 + 2 * 64 * 32 / 2) * 2 == 12288
    assert attn_shard_bytes(TOY, 4) == (2 * 64 * 64 / 4 + 2 * 64 * 16) * 2 == 8192
    assert (kv_share(TOY, 1), kv_share(TOY, 2), kv_share(TOY, 4)) == (1.0, 0.5, 0.5)
    assert [n for n in range(1, 9) if splits_over(TOY, n)] == [1, 2, 4]
    assert [n for n in range(1, 40) if splits_over(LLAMA_8B, n)] == [1, 2, 4, 8, 16, 32]


def test_sliding_window_layers_read_at_most_their_window() -> None:
    """Gemma 3: 3 of 18 layers read the whole context, 15 at most 512 tokens."""
    assert kv_tokens_per_layer(GEMMA3_270M, 256) == 256
    assert kv_tokens_per_layer(GEMMA3_270M, 4096) == (3 * 4096 + 15 * 512) / 18
    assert kv_tokens_per_layer(LLAMA_8B, 4096) == 4096


def test_colocated_step_by_hand() -> None:
    """Memory-bound: per layer 1 ms + weights + 2 sequences x 10 tokens of KV, then 1 ms + MLP weights; 2 layers."""
    attention = 1e-3 + 24576 / 1e6 + 2 * 10 * 128 / 1e6
    mlp = 1e-3 + 49152 / 1e6
    assert attention_time(TOY, SLOW, 2, 10) == pytest.approx(attention)
    assert mlp_time(TOY, SLOW, 2) == pytest.approx(mlp)
    plan = colocated(TOY, SLOW, 2, 10)
    assert (plan.devices, plan.per_replica) == (1, 2)
    assert plan.step_s == pytest.approx(2 * (attention + mlp))
    assert plan.tokens_per_device_s(2) == pytest.approx(2 / plan.step_s)


def test_colocated_splits_a_batch_whose_kv_does_not_fit() -> None:
    """Room for 3 sequences after the weights: a batch of 7 needs 3 replicas of 3, 3 and 1 (3 each: the slowest)."""
    weights = TOY.layers * (24576 + 49152)
    dev = Device("small", 1e6, 1e6, 1e18, 0.0, weights + 3 * kv_bytes_per_seq(TOY, 10) + 1)
    plan = colocated(TOY, dev, 7, 10)
    assert (plan.devices, plan.per_replica) == (3, 3)
    assert colocated(TOY, dev, 3, 10).devices == 1


def test_link_bound_step_is_the_link_time() -> None:
    """Free compute, a slow link: each layer costs one transfer per micro-batch (2), plus one transfer of fill."""
    free = Device("free", math.inf, math.inf, math.inf, 0.0, 1e18)
    link = Link("slow", 1e9, 10e-6)
    plan = disaggregated_at(TOY, free, link, 8, 16, attn_workers=1, ffn_workers=1)
    t_c = 10e-6 + 4 * 64 * 2 / 1e9  # a micro-batch of 4 rows of 64 bf16 values
    assert (plan.t_attn_s, plan.t_ffn_s) == (0.0, 0.0)
    assert plan.t_link_s == pytest.approx(t_c)
    assert plan.step_s == pytest.approx((2 * TOY.layers + 1) * t_c) == pytest.approx(5 * 1.0512e-5)
    assert plan.bottleneck == "link"


def test_head_split_step_by_hand() -> None:
    """A = 2 head-split workers, F = 1, memory-bound: each worker reads half the projections and half of every
    sequence's KV for the whole micro-batch of 4, then a ring all-reduce of its [4, 64] (2 steps of half of it);
    the rows go once to the one FFN worker and come back to both attention workers. Data-parallel attention on the
    same batch: each worker all the projections for its 2 sequences, the rows each way once."""
    link = Link("link", 1e6, 1e-3)
    row = 64 * 2
    plan = disaggregated_at(TOY, SLOW, link, 8, 10, attn_workers=2, ffn_workers=1)
    t_a = 1e-3 + 12288 / 1e6 + 4 * 10 * 128 / 2 / 1e6 + 2 * (1e-3 + 4 * row / 2 / 1e6)
    t_f = 1e-3 + 49152 / 1e6
    t_c, t_r = 1e-3 + 4 * row / 1e6, 1e-3 + 2 * 4 * row / 1e6
    assert all_reduce_time(link, 2, 4 * row) == pytest.approx(2 * (1e-3 + 4 * row / 2 / 1e6))
    assert all_reduce_time(link, 1, 4 * row) == 0.0
    assert plan.t_attn_s == pytest.approx(t_a) and plan.t_ffn_s == pytest.approx(t_f)
    assert plan.t_link_s == pytest.approx(t_c) and plan.t_return_s == pytest.approx(t_r)
    assert plan.step_s == pytest.approx(pingpong_step(t_a, t_f, t_c, TOY.layers, 2, t_r))
    assert plan.step_s == pytest.approx(TOY.layers * 2 * t_f + (t_a + t_c + t_r))  # FFN-bound, plus the fill
    data_parallel = disaggregated_at(TOY, SLOW, link, 8, 10, 2, 1, attention="sequences")
    assert data_parallel.t_attn_s == pytest.approx(1e-3 + 24576 / 1e6 + 2 * 10 * 128 / 1e6)
    assert data_parallel.t_link_s == data_parallel.t_return_s == pytest.approx(link_time(link, 4 * row))
    # Three workers cannot split the toy's four heads: no such plan (data-parallel attention takes any A).
    assert disaggregated_at(TOY, SLOW, link, 8, 10, 3, 1).devices == 0
    assert disaggregated_at(TOY, SLOW, link, 8, 10, 3, 1, attention="sequences").devices == 4


def test_head_split_kv_stops_shrinking_past_the_kv_heads() -> None:
    """8B at 32k context (4 GiB of KV a sequence) on the H100-like device: each head-split worker holds 1/A of the
    KV only up to A = 8 KV heads, so 64 sequences fit 4 workers and 256 fit none (A = 16 and 32 hold 1/8 too);
    data-parallel attention spreads the 256 over 15 workers (colocated decode over 19 replicas)."""
    assert kv_share(LLAMA_8B, 8) == kv_share(LLAMA_8B, 32) == 1 / 8
    assert min_attn_workers(LLAMA_8B, H100_LIKE, 64, 32768) == 4
    assert min_attn_workers(LLAMA_8B, H100_LIKE, 256, 32768) is None
    assert disaggregated(LLAMA_8B, H100_LIKE, Link("fast", 400e9, 5e-6), 256, 32768).devices == 0
    assert min_attn_workers(LLAMA_8B, H100_LIKE, 256, 32768, "sequences") == 15
    assert colocated(LLAMA_8B, H100_LIKE, 256, 32768).devices == 19


def test_a_batch_of_one_is_one_micro_batch() -> None:
    """One sequence cannot be split: each layer is its attention, FFN and both transfers, one after the other."""
    link = Link("link", 1e6, 1e-3)
    plan = disaggregated_at(TOY, SLOW, link, 1, 10, attn_workers=1, ffn_workers=1)
    t_a, t_f, t_c = attention_time(TOY, SLOW, 1, 10), mlp_time(TOY, SLOW, 1), 1e-3 + 64 * 2 / 1e6
    assert plan.micro_batches == 1
    assert plan.step_s == pytest.approx(TOY.layers * (t_a + t_f + 2 * t_c))


def test_stage_bound_step_by_hand() -> None:
    """Attention 3, FFN 1, link 0.5 (ms), 2 micro-batches, 4 layers: 4 x 2 x 3 + (3 + 1 + 1 - 3) = 26 ms."""
    assert pingpong_step(3.0, 1.0, 0.5, 4, 2) == pytest.approx(26.0)
    # Too few micro-batches to hide the transfers: a micro-batch's round trip (1 + 1 + 2 x 2 = 6) per layer.
    assert pingpong_step(1.0, 1.0, 2.0, 4, 2) == pytest.approx(4 * 6 + 2 * 2 - 2)


def test_pingpong_closed_form_is_the_schedule() -> None:
    """The closed form equals the event-by-event round-robin schedule on random stage times."""
    rng = random.Random(40)
    for _ in range(3000):
        t_a, t_f, t_c, t_r = (rng.choice([0.0, 1.0, rng.random()]) for _ in range(4))
        layers, micro = rng.randint(1, 6), rng.randint(1, 4)
        assert pingpong_step(t_a, t_f, t_c, layers, micro) == pytest.approx(
            pingpong_reference(t_a, t_f, t_c, layers, micro), abs=1e-12
        ), (t_a, t_f, t_c, layers, micro)
        # The transfer back as long as the head split makes it (one copy per attention worker).
        assert pingpong_step(t_a, t_f, t_c, layers, micro, t_r) == pytest.approx(
            pingpong_reference(t_a, t_f, t_c, layers, micro, t_r), abs=1e-12
        ), (t_a, t_f, t_c, t_r, layers, micro)


@pytest.mark.parametrize("shape", [AfdShape(), SEQUENCES], ids=lambda s: s.attention)
@pytest.mark.parametrize("dev", [H100_LIKE, CPU_LIKE, SLOW], ids=lambda d: d.name)
@pytest.mark.parametrize("cfg", list(MODELS.values()), ids=lambda c: c.name)
def test_a_batch_of_one_never_pays(cfg: ModelConfig, dev: Device, shape: AfdShape) -> None:
    """One sequence: nothing to ping-pong, two or more devices where one does the same work (a head split's
    workers each pay the overhead once more)."""
    for link in (Link("slow", 1e9, 1e-4), Link("fast", 1e15, 0.0)):
        for context in (16, 4096, 32768):
            if colocated(cfg, dev, 1, context).devices:
                assert speedup(cfg, dev, link, 1, context, shape) < 1.0, (link, context)


def test_break_even_batch_moves_down_as_bandwidth_goes_up() -> None:
    """8B at 32k context on the H100-like device, data-parallel attention: none on slow links, then smaller as the
    link gets faster. The built head split never breaks even there, but its best speed-up grows with the link."""
    grid = batch_grid(1024)
    found, best = [], []
    for gbps in (0.5, 2, 4, 8, 32, 128, 512):
        link = Link(f"{gbps}", gbps * 1e9, 5e-6)
        even = break_even_batch(LLAMA_8B, H100_LIKE, link, 32768, grid, SEQUENCES)
        found.append(math.inf if even is None else even)
        assert break_even_batch(LLAMA_8B, H100_LIKE, link, 32768, grid) is None
        best.append(max(speedup(LLAMA_8B, H100_LIKE, link, b, 32768) for b in grid))
    assert found == sorted(found, reverse=True)
    assert found[0] == math.inf and found[-1] < found[2] < math.inf
    assert best == sorted(best) and best[0] < best[-1] < 1.0


def test_afd_pays_only_when_colocated_is_short_of_memory() -> None:
    """8B on the H100-like device: data-parallel attention wins at 32k context and a large batch, where colocated
    replicas each re-read all the weights for a few sequences; the head split cannot hold that batch's KV (its
    workers stop shrinking it at 8) and does not win on the batches it holds; at 512 tokens neither ever wins."""
    fast = Link("fast", 400e9, 5e-6)
    assert speedup(LLAMA_8B, H100_LIKE, fast, 256, 32768, SEQUENCES) > 1.0
    assert speedup(LLAMA_8B, H100_LIKE, fast, 256, 32768) == 0.0
    assert 0.8 < speedup(LLAMA_8B, H100_LIKE, fast, 64, 32768) < 1.0
    for shape in (AfdShape(), SEQUENCES):
        assert max(speedup(LLAMA_8B, H100_LIKE, fast, b, 512, shape) for b in batch_grid(1024)) < 1.0


@pytest.mark.parametrize("shape", [AfdShape(), SEQUENCES], ids=lambda s: s.attention)
@pytest.mark.parametrize(("batch", "context"), [(3, 4096), (64, 512), (200, 32768), (1024, 4096)])
def test_chosen_workers_are_the_best(batch: int, context: int, shape: AfdShape) -> None:
    """The A and F chosen match a search of every A up to the micro-batch (and up to the heads) and every F up
    to 8; a fixed A and F are kept."""
    for link in (Link("slow", 2e9, 80e-6), Link("fast", 400e9, 5e-6)):
        chosen = disaggregated(LLAMA_8B, H100_LIKE, link, batch, context, shape)
        best = max(
            disaggregated_at(
                LLAMA_8B, H100_LIKE, link, batch, context, a, f, attention=shape.attention
            ).tokens_per_device_s(batch)
            for a in range(1, max(batch // 2, LLAMA_8B.heads) + 2)
            for f in range(1, 9)
        )
        assert chosen.tokens_per_device_s(batch) == pytest.approx(best)
        fixed_shape = AfdShape(attn_workers=16, ffn_workers=2, attention=shape.attention)
        fixed = disaggregated(LLAMA_8B, H100_LIKE, link, batch, 4096, fixed_shape)
        assert (fixed.attn_workers, fixed.ffn_workers) == (16, 2)


def test_fit_link_recovers_latency_and_bandwidth() -> None:
    """Through exact points, noise on a middle size ignored; one size or one point is refused."""
    points = [(b, 50e-6 + b / 2e9) for b in (1024, 65536, 2**24)]
    points.insert(1, (8192, 5e-3))
    link = fit_link(points)
    assert link.latency_s == pytest.approx(50e-6) and link.bandwidth == pytest.approx(2e9)
    with pytest.raises(ValueError):
        fit_link([(10, 1.0)])
    with pytest.raises(ValueError):
        fit_link([(10, 1.0), (10, 2.0)])


def test_fit_device_recovers_the_device_that_made_the_points() -> None:
    """Layer times generated by a known device fit back to its bandwidths and FLOP/s."""
    mlp = [(n, mlp_time(LLAMA_8B, CPU_LIKE, n)) for n in (1, 8, 512)]
    attn = [(s, c, attention_time(LLAMA_8B, CPU_LIKE, s, c)) for s, c in ((1, 512), (8, 512), (32, 512))]
    fitted = fit_device(LLAMA_8B, "fit", CPU_LIKE.overhead_s, CPU_LIKE.capacity_bytes, mlp, attn)
    assert fitted.weight_bw == pytest.approx(CPU_LIKE.weight_bw)
    assert fitted.flops == pytest.approx(CPU_LIKE.flops)
    assert fitted.kv_bw == pytest.approx(CPU_LIKE.kv_bw)


def test_batch_grid() -> None:
    """Four sizes an octave, from 1 to the largest, without repeats."""
    assert batch_grid(16) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 13, 16]
    assert batch_grid(1024)[-1] == 1024 and len(batch_grid(1024)) == len(set(batch_grid(1024)))


TINY = ModelConfig("tiny", hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, head_dim=8)


def test_calibration_measures_tiny_layers_and_fits_them() -> None:
    """The MLP and attention timings run at tiny sizes (bf16 weights) and fit a finite device."""
    mlp = afd_calibrate.measure_mlp(TINY, (1, 4), reps=1, cache_bytes=2**16)
    attn = afd_calibrate.measure_attention(TINY, ((1, 16), (4, 32)), reps=1, cache_bytes=2**16)
    assert [n for n, _ in mlp] == [1, 4] and all(t > 0 for _, t in mlp)
    assert [(s, c) for s, c, _ in attn] == [(1, 16), (4, 32)] and all(t > 0 for *_, t in attn)
    dev = fit_device(TINY, "tiny", afd_calibrate.measure_overhead(reps=10), 2**30, mlp, attn)
    assert all(math.isfinite(v) and v > 0 for v in (dev.weight_bw, dev.kv_bw, dev.flops))
    assert afd_calibrate.layer_copies(1e6, 2**20) == 5 and afd_calibrate.layer_copies(1e9, 2**20) == 1


def test_gloo_exchange_between_two_processes_on_loopback() -> None:
    """Two spawned ranks ping-pong [tokens, hidden] bytes over gloo on 127.0.0.1; rank 0 checks each echo."""
    sizes = [64, 64 * 256]
    points = afd_calibrate.measure_gloo(sizes, reps=3, timeout_s=120)
    assert [b for b, _ in points] == sizes
    assert all(math.isfinite(s) and s > 0 for _, s in points)
    link = fit_link(points, "gloo loopback")
    assert link.bandwidth > 0 and link.latency_s >= 0


def test_simulate_afd_prints_the_tables(capsys: pytest.CaptureFixture[str]) -> None:
    """tools/simulate.py --afd: the model header, one table row per batch, the break-even table."""
    simulate = load_tool("simulate.py")
    args = ["--afd", "--afd-batches", "1", "256", "--afd-contexts", "32768", "--afd-link-gbps", "100"]
    assert simulate.main(args) == 0
    out = capsys.readouterr().out
    assert "llama-8b, hidden 4096, intermediate 14336, 32 layers" in out and "run on " in out
    assert "context 32768" in out and "break-even batch" in out
    rows = [line for line in out.splitlines() if line.lstrip().startswith(("1 |", "256 |"))]
    assert len(rows) == 2 and "x" in rows[0]
    assert "attention split over the heads (as built" in out
    # The built head split never breaks even at 32k (batch 256's KV does not fit its workers); data-parallel does.
    assert re.search(r"^H100-like\s+32768 \|\s+- \(0\.\d\dx\)", out, re.MULTILINE), out
    assert re.search(r"^\s+256 \|.*\| +- +- +- +- mem", out, re.MULTILINE), out
    assert simulate.main([*args, "--afd-attention", "sequences"]) == 0
    out = capsys.readouterr().out
    assert "data-parallel attention (not built" in out
    assert re.search(r"^H100-like\s+32768 \|\s+108 \(1\.\d\dx\)", out, re.MULTILINE), out
    assert simulate.main([*args, "--afd-model", "smollm2-135m"]) == 0
    assert (
        "smollm2-135m, hidden 576, intermediate 1536, 30 layers, 9 heads / 3 KV heads x 64"
        in capsys.readouterr().out
    )
