"""Engine construction: device and dtype choice, model loading, KV-cache sizing."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from pagoda.pagedkernel import KernelBackend, get_backend
from pagoda.pagedkernel.cpu_backend import CpuBackend
from pagoda.pagedkernel.quant import QuantBackendName
from pagoda.server.config import EngineConfig
from pagoda.server.engine.host import BFLOAT16_MIN_SPEEDUP, cached_bfloat16_speedup, keep_freed_memory
from pagoda.server.engine.kv_cache import KVCache, KVCacheShape
from pagoda.server.engine.kv_dtype import check_kv_cache_dtype, storage_dtype
from pagoda.server.engine.kv_groups import KVCacheLayout, plan_kv_cache_layout
from pagoda.server.engine.model_runner import ModelRunner, RunnerHook
from pagoda.server.loader import DEFAULT_MODEL_NAME, load_model, load_shard
from pagoda.server.loader.quantize_at_load import load_qtype
from pagoda.server.lora.build import build_manager
from pagoda.server.lora.manager import LoRAManager
from pagoda.server.models.attention import Attention
from pagoda.server.models.base import CausalLM
from pagoda.server.models.parallel import ParallelGroup
from pagoda.server.models.quantized import resident_weight_bytes
from pagoda.server.startup import log_phase
from transformers import GenerationConfig, PreTrainedTokenizerBase

logger = logging.getLogger("pagoda.engine")
_PACK_BATCH = 128

# The cap for models whose context is longer (a 128k KV cache per request is rarely wanted).
DEFAULT_MAX_MODEL_LEN = 8192
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EngineConfigError(ValueError):
    """The configuration cannot serve (e.g. one max-length request does not fit in the KV cache)."""


class MaxModelLenError(EngineConfigError):
    """--max-model-len asks for a longer sequence than the KV pool holds: a bad flag (the CLI exits 2)."""


@dataclass(frozen=True)
class EngineParts:
    """Everything `LLMEngine` is built from."""

    model: CausalLM
    tokenizer: PreTrainedTokenizerBase
    model_name: str
    model_path: Path
    device: torch.device
    dtype: torch.dtype  # of the weights, activations and KV cache
    backend: KernelBackend
    kv_cache: KVCache
    max_model_len: int
    max_num_batched_tokens: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    lora: LoRAManager | None = None  # this rank's adapter slots (`with_lora`); None: LoRA is off

    @property
    def runner_hooks(self) -> tuple[RunnerHook, ...]:
        """What the model runner calls around each forward pass (the adapter slots, with LoRA)."""
        return () if self.lora is None else (self.lora,)

    def runner(self) -> ModelRunner:
        """The model runner over these parts' model and KV cache."""
        return ModelRunner(self.model, self.kv_cache, self.backend, self.device, self.runner_hooks)


def with_lora(config: EngineConfig, parts: EngineParts) -> EngineParts:
    """`parts` with their model's adapter slots built, when `config` enables LoRA."""
    return dataclasses.replace(parts, lora=build_manager(config, parts.model, parts.dtype, parts.device))


def select_device(config: EngineConfig) -> torch.device:
    """The configured device, else CUDA when available, else the CPU."""
    if config.model_config.device is not None:
        return torch.device(config.model_config.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def select_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    """The configured dtype; for "auto", bfloat16 on CUDA and on CPUs that multiply it fast, else float32.

    Like vLLM's "auto", this runs float32 checkpoints (the default model's GGUF dequantizes to float32) in
    bfloat16 where the hardware has bfloat16 units: whether the CPU does is measured, not guessed from its name.
    """
    if config.model_config.dtype != "auto":
        return _DTYPES[config.model_config.dtype]
    if device.type != "cpu":
        return torch.bfloat16
    speedup = cached_bfloat16_speedup()
    dtype = torch.bfloat16 if speedup >= BFLOAT16_MIN_SPEEDUP else torch.float32
    logger.info("dtype auto: bfloat16 matmul measured %.2gx float32 on this CPU -> %s", speedup, dtype)
    return dtype


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model_path: Path) -> frozenset[int]:
    """The tokenizer's eos plus any the model's generation_config.json lists (Gemma 3 ends turns with two)."""
    ids: set[int] = set()
    if isinstance(tokenizer.eos_token_id, int):
        ids.add(tokenizer.eos_token_id)
    if (model_path / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return frozenset(ids)


@dataclass(frozen=True, slots=True)
class Placement:
    """The device and dtype of a model's weights, activations and KV cache (the same on every rank)."""

    device: torch.device
    dtype: torch.dtype


def select_placement(config: EngineConfig) -> Placement:
    """The configured or detected device, and the dtype for it (see `select_dtype`)."""
    device = select_device(config)
    return Placement(device, select_dtype(config, device))


def dtype_name(dtype: torch.dtype) -> str:
    """The config's name of a dtype ("float32", ...)."""
    return next(name for name, value in _DTYPES.items() if value == dtype)


def parse_dtype(name: str) -> torch.dtype:
    """The dtype of a config name."""
    return _DTYPES[name]


def pack_rows(config: EngineConfig) -> int:
    """The batch hint weights are packed for: the decode batch, what the packed layout is tuned for (the hint
    matters little: measured 106-118 GFLOP/s for 110 rows across hints of 32-2048)."""
    return min(config.scheduler_config.max_num_seqs, _PACK_BATCH)


def prepare_model(
    model: CausalLM, config: EngineConfig, device: torch.device, *, compile_forward: bool = True
) -> None:
    """Pack the weights for the decode batch (CPU) or compile the forward (CUDA), once loaded."""
    rows = pack_rows(config)
    runner = config.model_config.runner
    if model.classifier() is not None and runner != "pooling":  # no LM head to generate with
        raise EngineConfigError(
            "the model is a sequence-classification model (a cross-encoder, no LM head): serve it "
            f"with --runner pooling, which answers /score and /rerank, not --runner {runner}"
        )
    # Pooling takes hidden states only; set before packing, which then keeps no packed copy of a tied LM head.
    model.computes_logits = runner == "generate"
    if packed := model.pack_weights(rows):
        logger.info("oneDNN: %d weight matrices packed once for batches of ~%d rows", packed, rows)
    if compile_forward and device.type == "cuda" and not config.model_config.enforce_eager:
        # Fuses the elementwise work around the kernels; the paged kernels themselves stay opaque calls.
        model.forward = torch.compile(model.forward, dynamic=True)  # type: ignore[method-assign]


def quant_backend(config: EngineConfig) -> QuantBackendName:
    """The quantized ops' backend for the configured kernel backend: torch and cpu as named, else auto."""
    backend = config.model_config.kernel_backend
    return backend if backend in ("torch", "cpu") else "auto"


def log_resident_weights(model: CausalLM) -> None:
    """Log the bytes of weights the model holds (quantized blocks and dense tensors), before any packing."""
    logger.info("weights: %.1f MiB resident", resident_weight_bytes(model) / 2**20)


def kv_cache_layout(model: CausalLM, config: EngineConfig) -> KVCacheLayout:
    """The model's KV cache groups: by attention type (the hybrid manager), or one group of every layer when
    `--disable-hybrid-kv-cache-manager` or the contiguous manager (which reserves whole regions) is on."""
    windows = [m.sliding_window for m in model.modules() if isinstance(m, Attention)]
    cache = config.cache_config
    hybrid = not cache.disable_hybrid_kv_cache_manager and cache.kv_manager == "paged"
    return plan_kv_cache_layout(windows, hybrid=hybrid)


def kv_cache_shape(model: CausalLM, config: EngineConfig, dtype: torch.dtype) -> KVCacheShape:
    """The per-layer KV geometry of a model (of this rank's shard: its KV heads only), grouped, and stored as
    --kv-cache-dtype says."""
    spec = model.kv_cache_spec()
    layout = kv_cache_layout(model, config)
    if layout.num_layers != spec.num_layers:
        raise ValueError(f"{layout.num_layers} attention layers, but a KV cache spec of {spec.num_layers}")
    return KVCacheShape(
        layout.layers_per_group,
        spec.num_kv_heads,
        spec.head_dim,
        config.cache_config.block_size,
        dtype,
        cache_dtype=storage_dtype(config.cache_config.kv_cache_dtype, dtype),
        layout=None if len(layout.groups) == 1 and not layout.is_hybrid else layout,
    )


def longest_sequence(layout: KVCacheLayout, num_blocks: int, block_size: int, chunk_tokens: int) -> int:
    """The most tokens one sequence can reach in `num_blocks` blocks (prefilled in chunks of `chunk_tokens`)."""
    lo, hi = 0, 1 << 30
    while lo < hi:  # the largest n with blocks_for_tokens(n) <= num_blocks: the count only grows with n
        mid = (lo + hi + 1) // 2
        if layout.blocks_for_tokens(mid, block_size, min(chunk_tokens, mid)) <= num_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo


def prepare_kernels(backend: KernelBackend, dtype: torch.dtype, config: EngineConfig | None = None) -> None:
    """Compile the kernels of the engine's dtype (over its KV cache's dtype) now, at start-up: not while the
    first request waits."""
    # The activations share the weights' dtype, so it is the one activation dtype the kernels see.
    if isinstance(backend, CpuBackend):
        cache = None if config is None else storage_dtype(config.cache_config.kv_cache_dtype, dtype)
        backend.prepare([dtype], cache)


def build_shard(
    config: EngineConfig,
    folder: Path,
    placement: Placement,
    group: ParallelGroup,
) -> tuple[CausalLM, KernelBackend]:
    """A tensor-parallel worker's shard of the model, loaded and prepared (its KV cache comes later)."""
    if placement.device.type == "cpu":
        keep_freed_memory()
    check_kv_cache_dtype(config, placement.device)
    backend = get_backend(config.model_config.kernel_backend, placement.device)
    prepare_kernels(backend, placement.dtype, config)
    model, _ = load_shard(
        folder,
        dtype=placement.dtype,
        device=placement.device,
        group=group,
        keep_quantized=config.model_config.keeps_quantized(),
        quant_backend=quant_backend(config),
        quantize_to=load_qtype(config.model_config.quantization, config.model_config.quantization_group_size),
    )
    log_resident_weights(model)
    prepare_model(model, config, placement.device)
    return model, backend


def reload_model(
    config: EngineConfig,
    folder: Path,
    placement: Placement,
    *,
    quantize: bool = True,
    group: ParallelGroup | None = None,
) -> CausalLM:
    """A fresh copy of a model from its checkpoint folder, loaded and packed as at start-up (sleep mode's wake
    reads released weights back this way; the copy's tensors move into the sleeping model's). `quantize`: the
    target model's --quantization int8 / int4 applies (a draft model is never quantized at load). `group`: a
    tensor-parallel rank's group, for its shard (loading a shard runs no collective)."""
    model_config = config.model_config
    quantization = model_config.quantization if quantize else None
    model, _ = load_shard(
        folder,
        dtype=placement.dtype,
        device=placement.device,
        group=group,
        keep_quantized=model_config.keeps_quantized(),
        quant_backend=quant_backend(config),
        quantize_to=load_qtype(quantization, model_config.quantization_group_size),
    )
    prepare_model(model, config, placement.device, compile_forward=False)
    return model


def _kv_bytes(config: EngineConfig, device: torch.device) -> float:
    """Bytes the KV cache may take: a fixed size on the CPU, what is left under the utilization on CUDA."""
    if device.type != "cuda":
        return config.cache_config.kv_cache_gib * 2**30
    free, total = torch.cuda.mem_get_info(device)
    return free - total * (1.0 - config.cache_config.gpu_memory_utilization)


def build_parts(
    config: EngineConfig, group: ParallelGroup | None = None, placement: Placement | None = None
) -> EngineParts:
    """Load the model (this rank's shard with a `group`) and size the KV cache; EngineConfigError when a
    max_model_len request cannot fit. `placement` is decided here unless given (a tensor-parallel driver decides
    it before its workers start)."""
    start = time.perf_counter()
    placement = placement or select_placement(config)
    start = log_phase("device and dtype", start)
    device, dtype = placement.device, placement.dtype
    if device.type == "cpu" and keep_freed_memory():
        logger.info("glibc malloc: freed large blocks are kept for reuse (no per-step page faults)")
    model_config, cache, scheduler = config.model_config, config.cache_config, config.scheduler_config
    check_kv_cache_dtype(config, device)
    backend = get_backend(model_config.kernel_backend, device)
    prepare_kernels(backend, dtype, config)
    start = log_phase("kernels", start)
    loaded = load_model(
        model_config.model,
        dtype=dtype,
        device=device,
        cache_dir=None if model_config.cache_dir is None else Path(model_config.cache_dir),
        tokenizer=model_config.tokenizer,
        group=group,
        keep_quantized=model_config.keeps_quantized(),
        quant_backend=quant_backend(config),
        quantize_to=load_qtype(model_config.quantization, model_config.quantization_group_size),
    )
    start = time.perf_counter()
    log_resident_weights(loaded.model)
    prepare_model(loaded.model, config, device)
    start = log_phase("packed weights", start)
    text_config = loaded.hf_config.get_text_config()
    model_limit = int(getattr(text_config, "max_position_embeddings", DEFAULT_MAX_MODEL_LEN))
    if scheduler.max_model_len is not None and scheduler.max_model_len > model_limit:
        raise EngineConfigError(
            f"max_model_len {scheduler.max_model_len} exceeds the model's max_position_embeddings "
            f"({model_limit}); lower --max-model-len"
        )
    shape = kv_cache_shape(loaded.model, config, dtype)
    layout = shape.layout or plan_kv_cache_layout([None] * shape.num_layers, hybrid=False)
    # num_kv_blocks counts memory in blocks of every layer (today's layout): the grouped pool of the same
    # memory has num_layers / layers_per_group times as many (smaller) blocks.
    num_blocks = (
        cache.num_kv_blocks * (layout.num_layers // layout.layers_per_group)
        if cache.num_kv_blocks
        else shape.blocks_in(_kv_bytes(config, device))
    )
    # A sliding-window group's block manager keeps one block aside: the null block.
    usable_blocks = max(num_blocks - layout.is_hybrid, 0)
    # The longest chunk a step computes: a sliding group holds its window plus that chunk while prefilling.
    chunk = scheduler.max_num_batched_tokens or (
        DEFAULT_MAX_NUM_BATCHED_TOKENS if scheduler.enable_chunked_prefill else 1 << 30
    )
    # A chunk shrinks to the free blocks (down to one block's tokens): one sequence alone needs only that peak.
    peak_chunk = min(chunk, cache.block_size) if scheduler.enable_chunked_prefill else chunk
    longest = longest_sequence(layout, usable_blocks, cache.block_size, peak_chunk)
    # The model's own context where the pool holds one such sequence (paged only: a contiguous reservation
    # takes max_model_len per sequence), else the capped default.
    own = cache.kv_manager == "paged" and longest >= model_limit
    max_model_len = scheduler.max_model_len or (
        model_limit if own else min(model_limit, DEFAULT_MAX_MODEL_LEN)
    )
    if longest < max_model_len:
        knob = "--gpu-memory-utilization" if device.type == "cuda" else "--kv-cache-gib"
        raise MaxModelLenError(
            f"max_model_len {max_model_len} does not fit: the KV cache holds {usable_blocks} blocks of "
            f"{cache.block_size} tokens ({layout.describe()}), at most {longest} tokens for one sequence, less "
            f"than one request of max_model_len ({max_model_len}); raise {knob} or lower --max-model-len"
        )
    if model_config.max_input_tokens is not None and model_config.max_input_tokens >= max_model_len:
        # TGI's rule: a prompt of max_input_tokens must leave room for at least one output token.
        raise EngineConfigError(
            f"max_input_tokens ({model_config.max_input_tokens}) must be below max_model_len ({max_model_len}); "
            "lower --max-input-tokens or raise --max-model-len (--max-total-tokens)"
        )
    num_host_blocks = (
        shape.blocks_in(cache.swap_space_gib * 2**30) if scheduler.preemption_mode != "recompute" else 0
    )
    kv_cache = KVCache(shape, num_blocks, num_host_blocks, device, backend)
    log_phase("KV pool", start)
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s, %.0f B/token); host tier %d blocks",
        num_blocks,
        cache.block_size,
        num_blocks * cache.block_size,
        num_blocks * shape.bytes_per_block / 2**30,
        shape.storage_dtype,
        shape.bytes_per_token,
        num_host_blocks,
    )
    log_capacity(layout, usable_blocks, cache.block_size, max_model_len, chunk)
    if scheduler.max_num_batched_tokens is not None:
        max_batched = scheduler.max_num_batched_tokens
    elif scheduler.enable_chunked_prefill:
        max_batched = DEFAULT_MAX_NUM_BATCHED_TOKENS
    else:
        max_batched = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len)
    return EngineParts(
        model=loaded.model,
        tokenizer=loaded.tokenizer,
        model_name=config.model_config.model or DEFAULT_MODEL_NAME,
        model_path=loaded.model_path,
        device=device,
        dtype=dtype,
        backend=backend,
        kv_cache=kv_cache,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_batched,
        vocab_size=int(text_config.vocab_size),
        eos_token_ids=eos_token_ids(loaded.tokenizer, loaded.model_path),
    )


def log_capacity(
    layout: KVCacheLayout, num_blocks: int, block_size: int, max_model_len: int, chunk: int
) -> None:
    """Log how many sequences of max_model_len tokens the pool holds, and what one takes in each group."""
    full = layout.blocks_for_tokens(max_model_len, block_size, min(chunk, max_model_len))
    per_group = [g.max_blocks(max_model_len, block_size) for g in layout.groups]
    logger.info(
        "KV cache groups: %s; one sequence of max_model_len %d holds %s blocks per group (%d in all): %d "
        "sequences at once (%.1f while prefilling in chunks of %d)",
        layout.describe(),
        max_model_len,
        "/".join(str(n) for n in per_group),
        sum(per_group),
        num_blocks // max(sum(per_group), 1),
        num_blocks / max(full, 1),
        chunk,
    )
