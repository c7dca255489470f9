"""Attention/FFN disaggregation (AFD) against colocated decode: a per-step cost model (issue #40, part 2).

Colocated decode: each device holds every weight and the KV of its sequences and runs whole layers; a batch
that does not fit one device's memory is split over data-parallel replicas, each reading all the weights.

AFD as built (`--attention-ffn-disaggregation`, engine/executor/afd.py; `AttentionSplit` "heads"): A attention
workers split every layer's heads as tensor parallelism does: each holds 1/A of the query heads and of the
q/k/v/o weights, and 1/A of the KV heads and so of every sequence's KV (with fewer KV heads than workers each
holds the one KV head its query heads read: past A = KV heads the KV no longer shrinks), and runs every sequence
of the micro-batch on its heads; o_proj's partial sums are all-reduced among the A workers ([tokens, hidden],
ring, over the same kind of link). Attention worker 0 sends each micro-batch's MLP input ([tokens, hidden]) to
each of the F FFN workers, and the first FFN worker sends the output back to each of the A attention workers.
F FFN workers each hold 1/F of every MLP (its intermediate columns, the dense analogue of experts spread over
workers). Both sides load tensor-parallel shards, so A and F must split the heads (the KV heads and the count
dividing one another) and the MLP width, as the engine checks at launch. The alternative, data-parallel attention
("sequences", MegaScale-Infer's shape, not built): each attention worker holds all the attention weights and the
KV of its share of the sequences, sends its rows to every FFN worker, and needs no all-reduce.

m micro-batches (2: ping-pong) take turns so that each side works on one while the other is in flight. With t_a
(one attention worker on its part of a micro-batch), t_f (one FFN worker on a micro-batch), t_c and t_r (the
transfer there and back, each direction on its own link), the round-robin schedule over L layers takes exactly

    step = L * max(m * t_max, t_a + t_f + t_c + t_r) + min(m * t_max, t_a + t_f + t_c + t_r) - t_max,
    t_max = max(t_a, t_f, t_c, t_r)

that is, the slowest stage once per layer per micro-batch plus the pipeline fill, or, when m micro-batches are
too few to hide the transfers, one micro-batch's whole round trip per layer (`pingpong_reference` is the
schedule itself, event by event).

Every op is a roofline: a fixed overhead plus the longer of its bytes over the bandwidth and its FLOPs over the
compute rate; weights and KV have their own bandwidths (a CPU streams a bf16 GEMV far below its copy bandwidth).
Decoder layers only (embedding and LM head left out, and with them the head split's vocabulary-parallel
all-reduce and gather); norms, rotary, the FFN workers' partial-sum reduction and KV writes are ignored, and the
attention workers' all-reduce does not contend with the FFN transfers; layers of one model are averaged
(sliding-window layers read at most their window).
"""

from __future__ import annotations

import contextlib
import math
import platform
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

# How the attention workers split attention: "heads" as built (tensor-parallel, every worker every sequence),
# "sequences" the data-parallel alternative (every worker all the attention weights, its share of the sequences).
AttentionSplit = Literal["heads", "sequences"]
ATTENTION_SPLITS: tuple[AttentionSplit, ...] = get_args(AttentionSplit)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shapes that set a decoder layer's bytes and FLOPs (gated MLP, grouped-query attention)."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    sliding_window: int | None = None  # local layers keep and read at most this many tokens
    global_every: int = 1  # every n-th layer attends to the whole context (1: all of them)


@dataclass(frozen=True, slots=True)
class Device:
    """One accelerator (or one CPU core): bandwidths in bytes/s, FLOP/s, seconds per op, usable bytes."""

    name: str
    weight_bw: float
    kv_bw: float
    flops: float
    overhead_s: float
    capacity_bytes: float


@dataclass(frozen=True, slots=True)
class Link:
    """A point-to-point link: one-way latency in seconds and bandwidth in bytes/s (each direction)."""

    name: str
    bandwidth: float
    latency_s: float


@dataclass(frozen=True, slots=True)
class Colocated:
    """Colocated decode of a batch: step seconds, devices (data-parallel replicas), sequences per replica."""

    step_s: float
    devices: int
    per_replica: int

    def tokens_per_device_s(self, batch: int) -> float:
        """Decoded tokens per second per device."""
        return batch / self.step_s / self.devices if math.isfinite(self.step_s) else 0.0


@dataclass(frozen=True, slots=True)
class Disaggregated:
    """AFD decode of a batch: step seconds, A and F, the per-layer stage times and micro-batch count."""

    step_s: float
    attn_workers: int
    ffn_workers: int
    t_attn_s: float  # one attention worker on a micro-batch, the head split's all-reduce included
    t_ffn_s: float
    t_link_s: float  # one micro-batch's transfer attention -> FFN
    t_return_s: float  # and back, FFN -> attention
    micro_batches: int

    @property
    def devices(self) -> int:
        """Attention plus FFN workers."""
        return self.attn_workers + self.ffn_workers

    @property
    def bottleneck(self) -> str:
        """Which stage sets the pace: attention, ffn, link, or round trip (too few micro-batches to hide it)."""
        link = max(self.t_link_s, self.t_return_s)
        stages = {"attention": self.t_attn_s, "ffn": self.t_ffn_s, "link": link}
        t_max = max(stages.values())
        if self.t_attn_s + self.t_ffn_s + self.t_link_s + self.t_return_s > self.micro_batches * t_max:
            return "round trip"
        return max(stages, key=lambda k: stages[k])

    def tokens_per_device_s(self, batch: int) -> float:
        """Decoded tokens per second per device."""
        return batch / self.step_s / self.devices if math.isfinite(self.step_s) else 0.0


@dataclass(frozen=True, slots=True)
class AfdShape:
    """A and F (None: chosen for the most tokens per second per device), micro-batches, the most F tried, and how
    attention splits over the A workers (the built head split by default)."""

    attn_workers: int | None = None
    ffn_workers: int | None = None
    micro_batches: int = 2
    max_ffn_workers: int = 8
    attention: AttentionSplit = "heads"


INFEASIBLE = Disaggregated(math.inf, 0, 0, math.inf, math.inf, math.inf, math.inf, 1)

LLAMA_8B = ModelConfig("llama-8b", 4096, 14336, 32, 32, 8, 128)
SMOLLM2_135M = ModelConfig("smollm2-135m", 576, 1536, 30, 9, 3, 64)
GEMMA3_270M = ModelConfig("gemma3-270m", 640, 2048, 18, 4, 1, 256, sliding_window=512, global_every=6)
MODELS = {m.name: m for m in (LLAMA_8B, SMOLLM2_135M, GEMMA3_270M)}
# H100 SXM-like: what a decode kernel sustains of 3.35 TB/s and of 989 dense bf16 TFLOP/s; 80 GiB at 90 %.
H100_LIKE = Device("H100-like", 3.0e12, 3.0e12, 700e12, 4e-6, 0.9 * 80 * 2**30)


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (the platform's processor string elsewhere)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def attn_weight_bytes(cfg: ModelConfig) -> int:
    """One layer's q, k, v and o projections, in bytes (one worker's share when it holds them all)."""
    return round(attn_shard_bytes(cfg, 1))


def splits_over(cfg: ModelConfig, workers: int) -> bool:
    """Whether tensor-parallel shards over `workers` exist, as the engine checks them (models/parallel.py): the
    count divides the query heads and the MLP width, and it and the KV heads divide one another."""
    kv_ok = cfg.kv_heads % workers == 0 or workers % cfg.kv_heads == 0
    return workers >= 1 and cfg.heads % workers == 0 and cfg.intermediate % workers == 0 and kv_ok


def kv_share(cfg: ModelConfig, shards: int) -> float:
    """The share of the KV heads one of `shards` head-split workers holds (one KV head when they are fewer)."""
    return max(1, cfg.kv_heads // shards) / cfg.kv_heads


def attn_shard_bytes(cfg: ModelConfig, shards: int) -> float:
    """One layer's q/k/v/o weights that one of `shards` head-split workers holds, in bytes (1: all of them)."""
    q_and_o = 2 * cfg.hidden * cfg.heads * cfg.head_dim / shards
    k_and_v = 2 * cfg.hidden * cfg.kv_heads * cfg.head_dim * kv_share(cfg, shards)
    return (q_and_o + k_and_v) * cfg.dtype_bytes


def mlp_weight_bytes(cfg: ModelConfig) -> int:
    """One layer's gated MLP (gate, up, down), in bytes."""
    return 3 * cfg.hidden * cfg.intermediate * cfg.dtype_bytes


def kv_bytes_per_token(cfg: ModelConfig) -> int:
    """K and V of one token in one layer, in bytes."""
    return 2 * cfg.kv_heads * cfg.head_dim * cfg.dtype_bytes


def global_layers(cfg: ModelConfig) -> int:
    """Layers attending to the whole context (the rest are sliding-window layers)."""
    return cfg.layers if cfg.sliding_window is None else cfg.layers // cfg.global_every


def kv_tokens_per_layer(cfg: ModelConfig, context: int) -> float:
    """Tokens of KV one layer reads for one sequence at `context`, averaged over the layers."""
    local = cfg.layers - global_layers(cfg)
    window = context if cfg.sliding_window is None else min(context, cfg.sliding_window)
    return (global_layers(cfg) * context + local * window) / cfg.layers


def kv_bytes_per_seq(cfg: ModelConfig, context: int) -> float:
    """KV one sequence at `context` keeps over all layers, in bytes."""
    return kv_tokens_per_layer(cfg, context) * cfg.layers * kv_bytes_per_token(cfg)


def roofline(bytes_: float, bandwidth: float, flops: float, rate: float) -> float:
    """The longer of moving `bytes_` and computing `flops` (no overhead)."""
    return max(bytes_ / bandwidth, flops / rate)


def projection_time(cfg: ModelConfig, dev: Device, seqs: int, shards: int = 1) -> float:
    """q/k/v/o projections of one layer for `seqs` tokens by one of `shards` head-split workers (no overhead)."""
    weights = attn_shard_bytes(cfg, shards)
    return roofline(weights, dev.weight_bw, 2 * seqs * weights / cfg.dtype_bytes, dev.flops)


def attention_core_time(cfg: ModelConfig, dev: Device, seqs: int, context: int, shards: int = 1) -> float:
    """Scores and weighted sum of one layer over each sequence's KV, on one of `shards` head-split workers' heads
    (no overhead)."""
    tokens = seqs * kv_tokens_per_layer(cfg, context)
    kv = tokens * kv_bytes_per_token(cfg) * kv_share(cfg, shards)
    return roofline(kv, dev.kv_bw, 4 * tokens * cfg.heads / shards * cfg.head_dim, dev.flops)


def attention_time(cfg: ModelConfig, dev: Device, seqs: int, context: int, shards: int = 1) -> float:
    """One layer's attention for `seqs` decoding sequences at `context` on one of `shards` head-split workers:
    overhead + projections + core (the all-reduce among the workers not included)."""
    if seqs <= 0:
        return 0.0
    return (
        dev.overhead_s
        + projection_time(cfg, dev, seqs, shards)
        + attention_core_time(cfg, dev, seqs, context, shards)
    )


def mlp_time(cfg: ModelConfig, dev: Device, tokens: int, shards: int = 1) -> float:
    """One layer's MLP on `tokens` tokens by one of `shards` workers holding 1/shards of it, with overhead."""
    if tokens <= 0:
        return 0.0
    weights = mlp_weight_bytes(cfg) / shards
    return dev.overhead_s + roofline(
        weights, dev.weight_bw, 2 * tokens * weights / cfg.dtype_bytes, dev.flops
    )


def link_time(link: Link, nbytes: float) -> float:
    """One transfer of `nbytes` over `link`: latency plus bytes over bandwidth."""
    return link.latency_s + nbytes / link.bandwidth


def all_reduce_time(link: Link, ranks: int, nbytes: float) -> float:
    """A ring all-reduce of `nbytes` among `ranks` over `link`: 2 (ranks - 1) steps of 1/ranks of the bytes each
    (nothing for one rank)."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) * link_time(link, nbytes / ranks)


def pingpong_step(
    t_attn: float,
    t_ffn: float,
    t_link: float,
    layers: int,
    micro_batches: int,
    t_return: float | None = None,
) -> float:
    """Closed form of the round-robin AFD schedule: slowest stage per layer and micro-batch, plus the fill.
    `t_return`: the transfer back (None: as long as `t_link`, the one there)."""
    back = t_link if t_return is None else t_return
    t_max = max(t_attn, t_ffn, t_link, back)
    round_trip = t_attn + t_ffn + t_link + back
    busy = micro_batches * t_max
    return layers * max(busy, round_trip) + min(busy, round_trip) - t_max


def pingpong_reference(
    t_attn: float,
    t_ffn: float,
    t_link: float,
    layers: int,
    micro_batches: int,
    t_return: float | None = None,
) -> float:
    """The same schedule event by event: attention, send, FFN, return per layer, each resource in turn."""
    durations = (t_attn, t_link, t_ffn, t_link if t_return is None else t_return)
    stages = 4 * layers
    end: dict[tuple[int, int], float] = {}
    for stage in range(stages):
        for mb in range(micro_batches):
            previous_stage = end.get((stage - 1, mb), 0.0)
            resource_free = end.get((stage, mb - 1) if mb else (stage - 4, micro_batches - 1), 0.0)
            end[stage, mb] = max(previous_stage, resource_free) + durations[stage % 4]
    return max(end[stages - 1, mb] for mb in range(micro_batches))


def colocated(cfg: ModelConfig, dev: Device, batch: int, context: int) -> Colocated:
    """Colocated decode: as few data-parallel replicas as the KV allows, each running whole layers."""
    room = dev.capacity_bytes - cfg.layers * (attn_weight_bytes(cfg) + mlp_weight_bytes(cfg))
    fits = math.floor(room / kv_bytes_per_seq(cfg, context)) if room > 0 else 0
    if fits < 1 or batch < 1:
        return Colocated(math.inf, 0, 0)
    replicas = math.ceil(batch / fits)
    seqs = math.ceil(batch / replicas)
    layer = attention_time(cfg, dev, seqs, context) + mlp_time(cfg, dev, seqs)
    return Colocated(cfg.layers * layer, replicas, seqs)


def head_split_fits(cfg: ModelConfig, dev: Device, batch: int, context: int, attn_workers: int) -> bool:
    """Whether A head-split attention workers exist for the model and each holds its shard of the attention
    weights and of the batch's KV."""
    if not splits_over(cfg, attn_workers):
        return False
    held = cfg.layers * attn_shard_bytes(cfg, attn_workers)
    kv = batch * kv_bytes_per_seq(cfg, context) * kv_share(cfg, attn_workers)
    return held + kv <= dev.capacity_bytes


def min_attn_workers(
    cfg: ModelConfig, dev: Device, batch: int, context: int, attention: AttentionSplit = "heads"
) -> int | None:
    """Fewest attention workers whose memory holds their attention weights and KV (None: none do). Heads: the
    smallest A that splits the model's heads whose shards fit (A beyond the KV heads holds no less KV);
    sequences: each worker all the attention weights and whole sequences."""
    if attention == "heads":
        return next(
            (a for a in range(1, cfg.heads + 1) if head_split_fits(cfg, dev, batch, context, a)), None
        )
    room = dev.capacity_bytes - cfg.layers * attn_weight_bytes(cfg)
    per_seq = kv_bytes_per_seq(cfg, context)
    if room < per_seq:
        return None
    return max(1, math.ceil(batch * per_seq / room))


def min_ffn_workers(cfg: ModelConfig, dev: Device) -> int:
    """Fewest FFN workers whose memory holds every layer's MLP."""
    return max(1, math.ceil(cfg.layers * mlp_weight_bytes(cfg) / dev.capacity_bytes))


def ffn_workers_allowed(cfg: ModelConfig, ffn_workers: int, attention: AttentionSplit) -> bool:
    """Whether F FFN workers can run: as built (heads) they load tensor-parallel shards, so F must split the
    model as A must; the data-parallel alternative is not built and takes any F."""
    return ffn_workers >= 1 and (attention == "sequences" or splits_over(cfg, ffn_workers))


def disaggregated_at(
    cfg: ModelConfig,
    dev: Device,
    link: Link,
    batch: int,
    context: int,
    attn_workers: int,
    ffn_workers: int,
    micro_batches: int = 2,
    attention: AttentionSplit = "heads",
) -> Disaggregated:
    """AFD with exactly A attention and F FFN workers (infinite step when they cannot hold or split the model)."""
    if (
        batch < 1
        or ffn_workers < min_ffn_workers(cfg, dev)
        or not ffn_workers_allowed(cfg, ffn_workers, attention)
    ):
        return INFEASIBLE
    m = min(micro_batches, batch)
    mb = math.ceil(batch / m)
    row = cfg.hidden * cfg.dtype_bytes
    t_f = mlp_time(cfg, dev, mb, ffn_workers)
    if attention == "heads":
        if not head_split_fits(cfg, dev, batch, context, attn_workers):
            return INFEASIBLE
        # Every worker runs every sequence on its heads, then all-reduces o_proj's [tokens, hidden] among them.
        t_a = attention_time(cfg, dev, mb, context, attn_workers) + all_reduce_time(
            link, attn_workers, mb * row
        )
        t_c = link_time(link, ffn_workers * mb * row)  # attention worker 0 sends every FFN worker the rows
        t_r = link_time(
            link, attn_workers * mb * row
        )  # the first FFN worker every attention worker the output
    else:
        least_a = min_attn_workers(cfg, dev, batch, context, "sequences")
        if least_a is None or attn_workers < least_a:
            return INFEASIBLE
        seqs = math.ceil(mb / attn_workers)
        t_a = attention_time(cfg, dev, seqs, context)
        # An attention worker sends its rows to every FFN worker; an FFN worker receives every row once.
        t_c = t_r = link_time(link, max(ffn_workers * seqs, mb) * row)
    step = pingpong_step(t_a, t_f, t_c, cfg.layers, m, t_r)
    return Disaggregated(step, attn_workers, ffn_workers, t_a, t_f, t_c, t_r, m)


def attn_worker_choices(
    cfg: ModelConfig, batch: int, least: int, micro_batches: int, attention: AttentionSplit = "heads"
) -> list[int]:
    """The A worth trying from the memory floor `least`. Heads: every A that splits the model's heads (each
    more worker reads less but adds to the all-reduce). Sequences: the smallest A for each share of a
    micro-batch (more workers with the same share only add devices)."""
    if attention == "heads":
        return [a for a in range(least, cfg.heads + 1) if splits_over(cfg, a)]
    mb = math.ceil(batch / min(micro_batches, batch))
    return sorted({max(least, math.ceil(mb / seqs)) for seqs in range(1, math.ceil(mb / least) + 1)})


def disaggregated(
    cfg: ModelConfig, dev: Device, link: Link, batch: int, context: int, shape: AfdShape = AfdShape()
) -> Disaggregated:
    """AFD at the shape's A and F, or where they are None at those with the most tokens/s per device."""
    least_a = min_attn_workers(cfg, dev, batch, context, shape.attention)
    if least_a is None or batch < 1:
        return INFEASIBLE
    least_f = min_ffn_workers(cfg, dev)
    m = shape.micro_batches
    if shape.ffn_workers is not None:
        ffns: Iterable[int] = [shape.ffn_workers]
    else:
        ffns = range(least_f, max(least_f, shape.max_ffn_workers) + 1)
    best = INFEASIBLE
    for f in ffns:
        if shape.attn_workers is not None:
            attns = [shape.attn_workers]
        else:
            attns = attn_worker_choices(cfg, batch, least_a, m, shape.attention)
        for a in attns:
            plan = disaggregated_at(cfg, dev, link, batch, context, a, f, m, shape.attention)
            if plan.tokens_per_device_s(batch) > best.tokens_per_device_s(batch):
                best = plan
    return best


def speedup(
    cfg: ModelConfig, dev: Device, link: Link, batch: int, context: int, shape: AfdShape = AfdShape()
) -> float:
    """AFD's tokens per second per device over colocated decode's (0 when AFD cannot run)."""
    base = colocated(cfg, dev, batch, context).tokens_per_device_s(batch)
    afd = disaggregated(cfg, dev, link, batch, context, shape).tokens_per_device_s(batch)
    if base == 0.0:
        return math.inf if afd > 0 else 0.0
    return afd / base


def batch_grid(largest: int) -> list[int]:
    """Batch sizes 1..largest four to an octave (1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 13, 16, ...)."""
    sizes = {min(largest, round(2 ** (k / 4))) for k in range(4 * max(1, largest).bit_length() + 1)}
    return sorted(sizes)


def break_even_batch(
    cfg: ModelConfig,
    dev: Device,
    link: Link,
    context: int,
    batches: Sequence[int],
    shape: AfdShape = AfdShape(),
) -> int | None:
    """The smallest of `batches` at which AFD's tokens per second per device reach colocated's (None: never)."""
    for batch in sorted(batches):
        if speedup(cfg, dev, link, batch, context, shape) >= 1.0:
            return batch
    return None


def fit_link(points: Sequence[tuple[float, float]], name: str = "measured") -> Link:
    """Latency + bytes/bandwidth through (bytes, one-way seconds): the slope between the smallest and the
    largest size (a noisy size between them does not tilt it), the latency at the smallest."""
    if len(points) < 2:
        raise ValueError("a link fit needs at least two sizes")
    (x0, y0), (x1, y1) = min(points), max(points)
    if x1 == x0:
        raise ValueError("a link fit needs two different sizes")
    slope = max((y1 - y0) / (x1 - x0), 1e-15)  # noise never gives a link faster than 1 PB/s
    return Link(name, 1.0 / slope, max(0.0, y0 - slope * x0))


def fit_device(
    cfg: ModelConfig,
    name: str,
    overhead_s: float,
    capacity_bytes: float,
    mlp_points: Sequence[tuple[int, float]],
    attn_points: Sequence[tuple[int, int, float]],
) -> Device:
    """A device fitted to measured layer times: the weight bandwidth and FLOP/s that best reproduce the
    (tokens, s) MLP points (least squared log error over the pairs the points imply), the KV bandwidth from how
    (seqs, context, s) attention times less the projections grow with the KV read (without two such points, the
    weights' bandwidth)."""
    weights = mlp_weight_bytes(cfg)
    mlp = [(n, max(t - overhead_s, 1e-9)) for n, t in mlp_points]
    bw_candidates = [weights / t for _, t in mlp]
    flop_candidates = [2 * n * weights / cfg.dtype_bytes / t for n, t in mlp]

    def mlp_error(bw: float, rate: float) -> float:
        """Squared log error of the MLP points under (bw, rate)."""
        dev = Device(name, bw, bw, rate, overhead_s, capacity_bytes)
        return sum(math.log(mlp_time(cfg, dev, n) / t) ** 2 for n, t in mlp_points)

    bw, rate = min(((b, r) for b in bw_candidates for r in flop_candidates), key=lambda p: mlp_error(*p))
    partial = Device(name, bw, bw, rate, overhead_s, capacity_bytes)
    kv_bw = bw
    if len(attn_points) >= 2:  # the slope of what the projections leave, between the least and the most KV
        by_kv = sorted(
            (s * kv_tokens_per_layer(cfg, c) * kv_bytes_per_token(cfg), t - projection_time(cfg, partial, s))
            for s, c, t in attn_points
        )
        (kv0, t0), (kv1, t1) = by_kv[0], by_kv[-1]
        if kv1 > kv0 and t1 > t0:
            kv_bw = (kv1 - kv0) / (t1 - t0)
    return Device(name, bw, kv_bw, rate, overhead_s, capacity_bytes)
