"""Engine arguments (vLLM's names where the meaning is the same) and the API's per-request limits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from pagoda.scheduler import PreemptionMode

KernelBackendName = Literal["auto", "torch", "cpu", "triton", "cupy"]
DTypeName = Literal["auto", "float32", "bfloat16", "float16"]
# static: traditional batching, a batch forms and runs to completion before the next is admitted.
SchedulingPolicyName = Literal["fcfs", "priority", "static"]
# contiguous: every sequence reserves max_model_len worth of blocks at admission (the pre-paging baseline).
KVManagerName = Literal["paged", "contiguous"]
ReasoningParserName = Literal["qwen3", "deepseek_r1"]  # --reasoning-parser (pagoda.server.api.reasoning)
ToolParserName = Literal[
    "hermes", "llama3_json", "mistral"
]  # --tool-call-parser (pagoda.server.api.tool_parsers)
# Where the processes beyond the first run: local processes (spawn) or Ray actors (tensor-parallel workers of one
# engine, and data-parallel engine-core replicas alike).
DistributedExecutorBackendName = Literal["mp", "ray"]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything needed to build an engine; None means "derive from the model or the machine"."""

    model: str | None = None  # HF folder or .gguf path; None: the default Gemma 3 270M
    tokenizer: str | None = None  # a folder with the tokenizer's files; None: the model's own
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings (capped at 8192)
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: 2048 if chunked prefill, else max(2048, max_model_len)
    block_size: int = 16
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of total GPU memory the engine may use
    kv_cache_gib: float = 4.0  # CPU: KV cache size
    swap_space_gib: float = 4.0  # host tier for preemption by swap
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None
    max_num_partial_prefills: int | None = None  # requests mid-prefill at once; None: no cap
    # TGI's knobs without a vLLM twin: prefill tokens per step (decodes apart), and a prompt cap (a 400 over it).
    max_batch_prefill_tokens: int | None = None
    max_input_tokens: int | None = None  # None: max_model_len - 1
    preemption_mode: PreemptionMode = "recompute"
    scheduling_policy: SchedulingPolicyName = "fcfs"
    # static: how long the oldest waiting request waits for a batch of max_num_seqs before a smaller one runs.
    static_batch_timeout_s: float = 0.0
    kv_manager: KVManagerName = "paged"
    enforce_eager: bool = False  # CUDA: run the model's forward uncompiled (every step, prefill and decode)
    kernel_backend: KernelBackendName = "auto"
    dtype: DTypeName = "auto"
    device: str | None = None  # "cuda" when available, else "cpu"
    seed: int = 0
    num_kv_blocks: int | None = None  # override the computed KV capacity (tests use tiny pools)
    cache_dir: str | None = None  # where converted GGUF models are cached
    tensor_parallel_size: int = 1  # ranks one model's layers are split over
    distributed_executor_backend: DistributedExecutorBackendName = "mp"

    def __post_init__(self) -> None:
        """Reject impossible sizes early, naming the field."""
        positive = {
            "max_num_seqs": self.max_num_seqs,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "num_kv_blocks": self.num_kv_blocks,
            "long_prefill_token_threshold": self.long_prefill_token_threshold,
            "max_num_partial_prefills": self.max_num_partial_prefills,
            "max_batch_prefill_tokens": self.max_batch_prefill_tokens,
            "max_input_tokens": self.max_input_tokens,
            "tensor_parallel_size": self.tensor_parallel_size,
        }
        for name, value in positive.items():
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.kv_cache_gib <= 0 or self.swap_space_gib < 0:
            raise ValueError("kv_cache_gib must be > 0 and swap_space_gib >= 0")
        if self.static_batch_timeout_s < 0:
            raise ValueError("static_batch_timeout_s must be >= 0")
        if self.scheduling_policy not in get_args(SchedulingPolicyName):
            raise ValueError(f"scheduling_policy must be one of {get_args(SchedulingPolicyName)}")
        if self.kv_manager not in get_args(KVManagerName):
            raise ValueError(f"kv_manager must be one of {get_args(KVManagerName)}")
        if self.distributed_executor_backend not in get_args(DistributedExecutorBackendName):
            raise ValueError(
                f"distributed_executor_backend must be one of {get_args(DistributedExecutorBackendName)}"
            )


# OpenAI's cap on the prompt array of one completion request; sequences (prompts x n) are capped at the same
# number by default, so that a small body cannot fan out into more engine work than a full prompt array.
DEFAULT_MAX_PROMPTS_PER_REQUEST = 2048
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 2048


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """How much fan-out one HTTP request may ask for (--max-prompts-per-request, --max-sequences-per-request)."""

    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST
