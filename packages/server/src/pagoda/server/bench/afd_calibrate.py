"""Calibrate the AFD cost model (`afd_model`) on this machine's CPU with torch: copy bandwidth, per-op
overhead, one decoder layer's MLP and attention at a few batch sizes (random weights of the model's shapes), and
the activation transfer between two processes over torch.distributed gloo on loopback.

Every time is the best of a few repetitions (the machine may be shared). The layer timings cycle through enough
copies of the layer that their weights and KV overflow the last-level cache, so that they stream from memory as
they do in a whole forward pass.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import queue as queue_module
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.queues import Queue
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from pagoda.server.bench.afd_model import (
    Device,
    Link,
    ModelConfig,
    attention_time,
    attn_weight_bytes,
    cpu_name,
    fit_device,
    fit_link,
    kv_bytes_per_token,
    kv_tokens_per_layer,
    mlp_time,
    mlp_weight_bytes,
)

MLP_TOKENS = (1, 8, 64)
ATTN_POINTS = ((1, 512), (8, 512), (32, 512))  # (sequences, context)
GLOO_TOKENS = (1, 16, 256, 2048)
WORKING_SET_CAP = 1536 * 2**20  # bytes of layer copies at most, whatever the cache


@dataclass(frozen=True, slots=True)
class Calibration:
    """What was measured here and the device and link fitted to it."""

    cpu: str
    threads: int
    copy_bw: float  # bytes/s, read + write
    overhead_s: float
    mlp_points: tuple[tuple[int, float], ...]  # (tokens, seconds per layer)
    attn_points: tuple[tuple[int, int, float], ...]  # (sequences, context, seconds per layer)
    link_points: tuple[tuple[int, float], ...]  # (bytes, one-way seconds)
    device: Device
    link: Link
    seconds: float


def last_level_cache_bytes() -> int:
    """The largest CPU cache of cpu0 in bytes (32 MiB when sysfs does not say)."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        with contextlib.suppress(OSError, ValueError):
            text = (index / "size").read_text().strip().upper()
            scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=32 * 2**20)


def memory_total_bytes() -> int:
    """MemTotal from /proc/meminfo (8 GiB when it cannot be read)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 8 * 2**30


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch.set_num_threads(threads) for the block, the previous count after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def best_time(fn: Callable[[], object], reps: int) -> float:
    """Seconds of the fastest of `reps` calls after one warm-up call."""
    fn()
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def torch_dtype(cfg: ModelConfig) -> torch.dtype:
    """bfloat16 for 2-byte configs, float32 for 4-byte ones."""
    return {2: torch.bfloat16, 4: torch.float32}[cfg.dtype_bytes]


def measure_copy_bandwidth(nbytes: int = 512 * 2**20, reps: int = 5) -> float:
    """Bytes/s of a large tensor copy, counting the read and the write."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / best_time(lambda: dst.copy_(src), reps)


def layer_copies(layer_bytes: float, cache_bytes: int) -> int:
    """Copies of a layer to cycle through: four times the cache, at least 2, within WORKING_SET_CAP."""
    wanted = math.ceil(4 * cache_bytes / max(layer_bytes, 1.0))
    return max(1, min(max(2, wanted), 64, int(WORKING_SET_CAP // max(layer_bytes, 1.0))))


def _mlp_weights(cfg: ModelConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random gate, up ([intermediate, hidden]) and down ([intermediate, hidden]) weights."""
    shape = (cfg.intermediate, cfg.hidden)
    return (
        torch.randn(shape, dtype=dtype) * 0.02,
        torch.randn(shape, dtype=dtype) * 0.02,
        torch.randn(shape, dtype=dtype) * 0.02,
    )


def _mlp(x: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A gated MLP: down(silu(gate(x)) * up(x))."""
    return (F.silu(x @ w[0].T) * (x @ w[1].T)) @ w[2]


def _attn_weights(cfg: ModelConfig, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Random q, k, v ([out, hidden]) and o ([hidden, heads * head_dim]) projections."""
    q_out, kv_out = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    shapes = ((q_out, cfg.hidden), (kv_out, cfg.hidden), (kv_out, cfg.hidden), (cfg.hidden, q_out))
    return tuple(torch.randn(s, dtype=dtype) * 0.02 for s in shapes)


def _attention(
    cfg: ModelConfig, x: torch.Tensor, w: tuple[torch.Tensor, ...], k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """One decode step of attention: projections, then one query per sequence over its cached K and V."""
    n = x.shape[0]
    q = (x @ w[0].T).view(n, cfg.heads, 1, cfg.head_dim)
    x @ w[1].T  # the new token's K and V, computed as a real layer does (not written: the model ignores it)
    x @ w[2].T
    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=cfg.heads != cfg.kv_heads)
    return out.reshape(n, cfg.heads * cfg.head_dim) @ w[3].T


def measure_overhead(reps: int = 200) -> float:
    """Seconds per layer side that torch spends whatever the size: one tiny attention and one tiny MLP, halved."""
    tiny = ModelConfig("tiny", 8, 16, 1, 2, 1, 4, dtype_bytes=4)
    mlp_w = _mlp_weights(tiny, torch.float32)
    attn_w = _attn_weights(tiny, torch.float32)
    x = torch.randn(1, tiny.hidden)
    k = torch.randn(1, tiny.kv_heads, 4, tiny.head_dim)

    def both() -> None:
        """One tiny attention and one tiny MLP."""
        for _ in range(10):
            _attention(tiny, x, attn_w, k, k)
            _mlp(x, mlp_w)

    return best_time(both, max(1, reps // 10)) / 20


def measure_mlp(
    cfg: ModelConfig, tokens: Sequence[int], reps: int = 5, cache_bytes: int | None = None
) -> list[tuple[int, float]]:
    """(tokens, seconds per layer) of the MLP, cycling through copies of the layer."""
    dtype = torch_dtype(cfg)
    copies = layer_copies(mlp_weight_bytes(cfg), cache_bytes or last_level_cache_bytes())
    layers = [_mlp_weights(cfg, dtype) for _ in range(copies)]
    points = []
    for n in tokens:
        x = torch.randn(n, cfg.hidden, dtype=dtype)

        def run(x: torch.Tensor = x) -> None:
            """Every copy of the layer once."""
            for w in layers:
                _mlp(x, w)

        points.append((n, best_time(run, reps) / copies))
    return points


def measure_attention(
    cfg: ModelConfig, points: Sequence[tuple[int, int]], reps: int = 5, cache_bytes: int | None = None
) -> list[tuple[int, int, float]]:
    """(sequences, context, seconds per layer) of decode attention, cycling through copies of the layer."""
    dtype = torch_dtype(cfg)
    result = []
    for seqs, context in points:
        cached = max(1, round(kv_tokens_per_layer(cfg, context)))
        layer_bytes = attn_weight_bytes(cfg) + seqs * cached * kv_bytes_per_token(cfg)
        copies = layer_copies(layer_bytes, cache_bytes or last_level_cache_bytes())
        kv_shape = (seqs, cfg.kv_heads, cached, cfg.head_dim)
        layers = [
            (
                _attn_weights(cfg, dtype),
                torch.randn(kv_shape, dtype=dtype),
                torch.randn(kv_shape, dtype=dtype),
            )
            for _ in range(copies)
        ]
        x = torch.randn(seqs, cfg.hidden, dtype=dtype)

        def run(
            x: torch.Tensor = x,
            layers: list[tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]] = layers,
        ) -> None:
            """Every copy of the layer once."""
            for w, k, v in layers:
                _attention(cfg, x, w, k, v)

        result.append((seqs, context, best_time(run, reps) / copies))
        del layers
    return result


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gloo_rank(rank: int, port: int, sizes: Sequence[int], reps: int, results: Queue[object]) -> None:
    """One rank of the ping-pong: rank 0 sends each size and times its echo from rank 1; checks the bytes."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=timedelta(seconds=60),
        )
        points = []
        for nbytes in sizes:
            sent = (torch.arange(nbytes, dtype=torch.int32) % 251).to(torch.uint8)
            buf = torch.empty(nbytes, dtype=torch.uint8)
            best = math.inf
            for i in range(reps + 1):  # the first exchange is the warm-up
                start = time.perf_counter()
                if rank == 0:
                    dist.send(sent, 1)
                    dist.recv(buf, 1)
                else:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
                if i:
                    best = min(best, time.perf_counter() - start)
            if rank == 0 and not torch.equal(buf, sent):
                raise RuntimeError(f"gloo echo of {nbytes} bytes came back different")
            points.append((nbytes, best / 2))
        if rank == 0:
            results.put(points)
        dist.destroy_process_group()
    except BaseException as exc:  # the parent reports it; the traceback is in this process's stderr
        results.put(f"rank {rank}: {exc!r}")
        raise


def measure_gloo(sizes: Sequence[int], reps: int = 20, timeout_s: float = 120.0) -> list[tuple[int, float]]:
    """(bytes, one-way seconds): two spawned processes ping-pong each size over gloo on 127.0.0.1."""
    ctx = mp.get_context("spawn")
    results: Queue[object] = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, list(sizes), reps, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = results.get(timeout=timeout_s)
    except queue_module.Empty:
        got = f"no answer from the gloo ranks within {timeout_s:.0f} s"
    finally:
        for p in procs:
            p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join()
    if isinstance(got, str):
        raise RuntimeError(got)
    assert isinstance(got, list)
    return [(int(b), float(s)) for b, s in got]


def calibrate(cfg: ModelConfig, threads: int = 1, memory_util: float = 0.9) -> Calibration:
    """Measure this machine (with `threads` torch threads) and fit a Device and a gloo loopback Link."""
    start = time.perf_counter()
    with torch_threads(threads), torch.inference_mode():
        copy_bw = measure_copy_bandwidth()
        overhead = measure_overhead()
        mlp = measure_mlp(cfg, MLP_TOKENS)
        attn = measure_attention(cfg, ATTN_POINTS)
    link_points = measure_gloo([n * cfg.hidden * cfg.dtype_bytes for n in GLOO_TOKENS])
    name = f"{cpu_name()}, {threads} thread{'s' * (threads != 1)}"
    device = fit_device(cfg, name, overhead, memory_util * memory_total_bytes(), mlp, attn)
    link = fit_link(link_points, "gloo loopback")
    return Calibration(
        cpu_name(),
        threads,
        copy_bw,
        overhead,
        tuple(mlp),
        tuple(attn),
        tuple(link_points),
        device,
        link,
        time.perf_counter() - start,
    )


def describe(cfg: ModelConfig, cal: Calibration) -> list[str]:
    """The calibration as lines of text: measured numbers next to what the fitted model gives back."""
    dev, dtype = cal.device, str(torch_dtype(cfg)).removeprefix("torch.")
    lines = [
        f"calibration on {cal.cpu} ({os.cpu_count()} CPUs), {cal.threads} torch thread(s), "
        f"{memory_total_bytes() / 2**30:.1f} GiB RAM, {cfg.name} shapes in {dtype}, {cal.seconds:.1f} s",
        f"  copy bandwidth (read + write): {cal.copy_bw / 1e9:.1f} GB/s; torch overhead per layer side: "
        f"{cal.overhead_s * 1e6:.0f} us",
    ]
    for n, t in cal.mlp_points:
        model = mlp_time(cfg, dev, n)
        lines.append(
            f"  MLP layer, {n:>4} tokens:            {t * 1e3:8.2f} ms measured, {model * 1e3:8.2f} ms model"
        )
    for s, c, t in cal.attn_points:
        model = attention_time(cfg, dev, s, c)
        lines.append(
            f"  attention layer, {s:>3} seqs x {c:>5}: {t * 1e3:8.2f} ms measured, {model * 1e3:8.2f} ms model"
        )
    lines.append(
        f"  fitted device ({cal.threads} thread(s) and this machine's RAM): weights {dev.weight_bw / 1e9:.1f} GB/s, KV {dev.kv_bw / 1e9:.1f} GB/s, "
        f"{dev.flops / 1e9:.0f} GFLOP/s, {dev.capacity_bytes / 2**30:.1f} GiB usable"
    )
    sizes = ", ".join(f"{b / 1024:.0f} KiB {s * 1e6:.0f} us" for b, s in cal.link_points)
    lines.append(f"  gloo loopback, 2 processes, one way: {sizes}")
    lines.append(
        f"  fitted link: {cal.link.latency_s * 1e6:.0f} us + bytes / {cal.link.bandwidth / 1e9:.2f} GB/s"
    )
    return lines
