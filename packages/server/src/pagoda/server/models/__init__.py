"""Model implementations over the paged KV cache: Llama 2/3, Mistral, Qwen2, Qwen3 and Gemma 3 (text)."""

from pagoda.server.models.attention import Attention, AttentionMetadata, LayerKVCache
from pagoda.server.models.base import CausalLM, KVCacheSpec, PackedShard
from pagoda.server.models.parallel import ParallelGroup, SingleRank, TensorParallelError
from pagoda.server.models.registry import (
    UnsupportedArchitectureError,
    build_model,
    model_class,
    supported_architectures,
)

__all__ = [
    "Attention",
    "AttentionMetadata",
    "CausalLM",
    "KVCacheSpec",
    "LayerKVCache",
    "PackedShard",
    "ParallelGroup",
    "SingleRank",
    "TensorParallelError",
    "UnsupportedArchitectureError",
    "build_model",
    "model_class",
    "supported_architectures",
]
