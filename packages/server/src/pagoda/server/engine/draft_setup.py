"""The draft model of `--speculative-config '{"method": "draft_model", "model": ...}'`: loaded, cached, timed.

The draft is loaded by the engine's loader (an HF folder or a .gguf file) on the target's device and dtype,
checked to share the target's vocabulary, and run by its own `ModelRunner` over its own KV cache tensors and
block pool. The pool holds as many tokens as the target's (plus one block per batch seat for the drafts in
flight), so its memory is the target's KV memory times the draft's KV bytes per token over the target's: a
few percent for a draft of a few percent of the target's layers x KV heads. It is allocated on top of the
target's `--kv-cache-gib` / `--gpu-memory-utilization` budget.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from pagoda.blockalloc import BlockManager
from pagoda.server.config import EngineConfig
from pagoda.server.engine.kv_cache import KVCache, KVCacheShape
from pagoda.server.engine.kv_dtype import storage_dtype
from pagoda.server.engine.model_runner import ModelRunner
from pagoda.server.engine.preemption_costs import _best_seconds, _probe_step
from pagoda.server.engine.setup import EngineParts, prepare_model, quant_backend
from pagoda.server.loader import load_model
from pagoda.server.spec.draft_check import check_draft_vocabulary
from pagoda.server.spec.draft_model import DraftModel, Probabilities

logger = logging.getLogger("pagoda.engine")


@dataclass(frozen=True, slots=True)
class LoadedDraft:
    """The engine's draft model and its measured cost."""

    drafter: DraftModel
    token_seconds: float  # one draft decode step of one token (the back-off policy's price of a draft)


def draft_pool_blocks(parts: EngineParts, max_num_seqs: int) -> int:
    """Blocks of the draft's pool: the target pool's token capacity, plus one block per batch seat."""
    shape = parts.kv_cache.shape
    # With KV cache groups a target block holds the tokens of one group's layers only.
    tokens = parts.kv_cache.num_blocks * shape.block_size * shape.num_layers // len(shape.layer_slots())
    return -(-tokens // shape.block_size) + max_num_seqs


def load_draft(
    config: EngineConfig, parts: EngineParts, max_num_seqs: int, probabilities: Probabilities
) -> LoadedDraft | None:
    """The draft model of `config`'s speculative config (None unless its method is draft_model), drawing its
    sampled drafts from `probabilities` (the engine sampler's); ValueError naming the key 'model' for a draft
    of another vocabulary."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model" or spec.model is None:
        return None
    model_config = config.model_config
    cache_dir = None if model_config.cache_dir is None else Path(model_config.cache_dir)
    check_draft_vocabulary(
        model_config.model, spec.model, tokenizer=model_config.tokenizer, cache_dir=cache_dir
    )
    loaded = load_model(
        spec.model,
        dtype=parts.dtype,
        device=parts.device,
        cache_dir=cache_dir,
        keep_quantized=model_config.keeps_quantized(),
        quant_backend=quant_backend(config),
    )
    prepare_model(loaded.model, config, parts.device)
    kv_spec = loaded.model.kv_cache_spec()
    target = parts.kv_cache.shape
    # One group of every layer: the draft's pool never mixes sliding and full tables (a window only reads less).
    shape = KVCacheShape(
        kv_spec.num_layers,
        kv_spec.num_kv_heads,
        kv_spec.head_dim,
        target.block_size,
        parts.dtype,
        cache_dtype=storage_dtype(config.cache_config.kv_cache_dtype, parts.dtype),
    )
    num_blocks = draft_pool_blocks(parts, max_num_seqs)
    cache = KVCache(shape, num_blocks, 0, parts.device, parts.backend)
    runner = ModelRunner(loaded.model, cache, parts.backend, parts.device)
    target_bytes = parts.kv_cache.num_blocks * target.bytes_per_block
    logger.info(
        "draft model %s: KV pool of %d blocks x %d tokens (%.3f GiB, %.1f%% of the target's KV)",
        spec.model,
        num_blocks,
        shape.block_size,
        num_blocks * shape.bytes_per_block / 2**30,
        100 * num_blocks * shape.bytes_per_block / max(target_bytes, 1),
    )
    probe = _probe_step(1, shape.block_size)
    runner.execute(probe, {})  # warm-up (kernel selection; compilation on CUDA)
    seconds = _best_seconds(lambda: runner.execute(probe, {}), parts.device, 3)
    kv = BlockManager(num_blocks, shape.block_size, enable_prefix_caching=False)
    # Past the draft's own context, a sequence gets no drafts (the target may serve longer ones).
    text_config = loaded.hf_config.get_text_config()
    limit = min(
        parts.max_model_len, int(getattr(text_config, "max_position_embeddings", parts.max_model_len))
    )
    return LoadedDraft(DraftModel(runner, kv, limit, probabilities), seconds)
