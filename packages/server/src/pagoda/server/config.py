"""The one configuration: a tree of frozen sections, each validated once in its own `__post_init__`.

`ServeConfig` is what `pagoda serve` runs: the engine part (`EngineConfig`: model, cache, scheduler, parallel)
plus one section per consumer in front of it (the core client, `AsyncLLM`, the API app, the HTTP server).
Every leaf field has one flat name, the same as its CLI destination and its `LLM(**kwargs)` keyword;
`build_config` distributes flat names to sections by their dataclass fields (`pagoda.server.config_tree`).
vLLM's names where the meaning is the same.

The JSON sub-configs (`speculative_config`, `pooler_config`, `kv_events_config`) are parsed once, where text or a
dict enters: the CLI's flag types (`cli_args.py`) and `from_flat` (`LLM(**kwargs)`); the tree holds their typed
configs (or None), which every consumer reads as they are.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, get_args

from pagoda.scheduler import PreemptionMode, SchedulerConfig, SchedulingPolicyName
from pagoda.server.afd_config import FLAG as AFD_FLAG
from pagoda.server.afd_config import AttentionFFNConfig, parse_attention_ffn_config
from pagoda.server.config_tree import build_config, json_object
from pagoda.server.kv_events.config import KVEventsConfig, parse_kv_events_config
from pagoda.server.metrics import DEFAULT_METRICS_PREFIX
from pagoda.server.packaged import packaged_model
from pagoda.server.pooling.params import PoolerConfig, RunnerName, parse_pooler_config
from pagoda.server.routing import RoutingPolicyName
from pagoda.server.spec.config import SpeculativeConfig, parse_speculative_config

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_PROMPTS_PER_REQUEST",
    "DEFAULT_MAX_SEQUENCES_PER_REQUEST",
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "AppSettings",
    "CacheConfig",
    "CoreClientConfig",
    "DTypeName",
    "DistributedExecutorBackendName",
    "EngineConfig",
    "EngineCoreName",
    "EngineFailureName",
    "HTTPLimits",
    "KVCacheDtypeName",
    "KVEventsConfig",
    "KVManagerName",
    "KernelBackendName",
    "LoRAConfig",
    "LoRAModulePath",
    "LogLevelName",
    "ModalityLimits",
    "ModelConfig",
    "MultiModalConfig",
    "ParallelConfig",
    "PoolerConfig",
    "PreemptionMode",
    "QuantizationName",
    "ReasoningParserName",
    "RequestLimits",
    "RunnerName",
    "SchedulerConfig",
    "SchedulingPolicyName",
    "ServeConfig",
    "ServerConfig",
    "ServingConfig",
    "SpeculativeConfig",
    "StructuredOutputsConfig",
    "ToolParserName",
    "resolved_scheduler_config",
]

KernelBackendName = Literal["auto", "torch", "cpu", "triton", "cupy"]
DTypeName = Literal["auto", "float32", "bfloat16", "float16"]
# --quantization (vLLM's flag): gguf keeps a .gguf file's block formats, none dequantizes them at load, int8 and
# int4 quantize a safetensors checkpoint's weights at load (Q8_0 blocks; int4 groups of --quantization-group-size).
QuantizationName = Literal["gguf", "none", "int8", "int4"]
INT4_GROUP_SIZES = (32, 64, 128)
# contiguous: every sequence reserves max_model_len worth of blocks at admission (the pre-paging baseline).
KVOffloadingBackendName = Literal["native"]
KVManagerName = Literal["paged", "contiguous"]
# --kv-cache-dtype (vLLM's names): auto = the model's dtype; int8 with a scale per block and KV head; fp8 = e4m3
# (CUDA only). The same names as pagoda.pagedkernel.kv_quant.KVCacheDtypeName (this module does not import torch).
KVCacheDtypeName = Literal["auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"]
ReasoningParserName = Literal["qwen3", "deepseek_r1"]  # --reasoning-parser (pagoda.server.api.reasoning)
ToolParserName = Literal[
    "hermes", "llama3_json", "mistral"
]  # --tool-call-parser (pagoda.server.api.tool_parsers)
# Where the processes beyond the first run: local processes (spawn) or Ray actors (tensor-parallel workers of one
# engine, and data-parallel engine-core replicas alike).
DistributedExecutorBackendName = Literal["mp", "ray"]
EngineCoreName = Literal["inproc", "process"]
KVTransferName = Literal["shm", "tcp"]
LogLevelName = Literal["debug", "info", "warning", "error"]
# --on-engine-failure: what an in-process engine whose step raised does: rebuild itself, end the process, or (none)
# stay dead answering 503, /health included, for a load balancer or liveness probe to act on.
EngineFailureName = Literal["restart", "exit", "none"]


def _at_least(minimum: float, **values: float | None) -> None:
    """ValueError naming the first field below `minimum` (None passes: "derive it")."""
    for name, value in values.items():
        if value is not None and value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _one_of(name: str, value: str, choices: tuple[str, ...]) -> None:
    """ValueError naming the field when `value` is not one of `choices`."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, not {value!r}")


def _typed(name: str, value: object, kind: type) -> None:
    """ValueError naming the field when a JSON sub-config is neither None nor its typed config (text and dicts
    are parsed at the boundary: the CLI's flag types and `from_flat`)."""
    if value is not None and not isinstance(value, kind):
        raise ValueError(
            f"{name} must be a {kind.__name__} (from_flat parses JSON text or a dict), not {value!r}"
        )


# Images (issue 38). PIL warns above its MAX_IMAGE_PIXELS and refuses above twice that: --max-image-pixels stays
# at most PIL's, so that every image it admits clears PIL's own guard (which is left as it is: global state).
PIL_MAX_IMAGE_PIXELS = 89_478_485
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096  # 16.8 MP: a 12 MP photo fits; vision encoders resize far below it
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024  # OpenAI's per-image limit
DEFAULT_MEDIA_FETCH_TIMEOUT = 5.0  # seconds; vLLM's VLLM_IMAGE_FETCH_TIMEOUT
DEFAULT_MAX_IMAGES_PER_PROMPT = 8
MODALITIES = ("image",)  # what --limit-mm-per-prompt may name


@dataclass(frozen=True, slots=True)
class ModalityLimits:
    """--limit-mm-per-prompt (vLLM's JSON, `{"image": 4}`): items of each modality one prompt may carry."""

    image: int = DEFAULT_MAX_IMAGES_PER_PROMPT

    def __post_init__(self) -> None:
        """ValueError naming the modality."""
        if isinstance(self.image, bool) or not isinstance(self.image, int) or self.image < 0:
            raise ValueError(f"limit_mm_per_prompt: image must be a count >= 0, got {self.image!r}")


def parse_limit_mm_per_prompt(value: object) -> ModalityLimits:
    """--limit-mm-per-prompt's JSON text or dict (or a ModalityLimits, as is); ValueError naming the flag and
    the modality."""
    if isinstance(value, ModalityLimits):
        return value
    keys = json_object(value, "limit_mm_per_prompt", example='{"image": 4}')
    unknown = sorted(set(keys) - set(MODALITIES))
    if unknown:
        raise ValueError(
            f"limit_mm_per_prompt: unknown modality {unknown[0]!r} (served: {', '.join(MODALITIES)})"
        )
    return ModalityLimits(**keys)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class MultiModalConfig:
    """Images: how many one prompt may carry, where they may come from and how large they may be (the API's and
    `LLM`'s media policy, pagoda.server.multimodal.media)."""

    limit_mm_per_prompt: ModalityLimits | None = None  # None: DEFAULT_MAX_IMAGES_PER_PROMPT images
    # Exact host names http(s) image URLs may name; none: http(s) image URLs are refused without a connection.
    allowed_media_domains: tuple[str, ...] = ()
    # file:// image URLs only under this folder (symlinks resolved); None: file:// refused.
    allowed_local_media_path: str | None = None
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # one image's encoded size (data:, http(s), file)
    media_fetch_timeout: float = DEFAULT_MEDIA_FETCH_TIMEOUT  # seconds for a whole http(s) fetch
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # width x height, from the header, before decoding

    def __post_init__(self) -> None:
        """ValueError naming the field (the folder's existence is checked where images are loaded: an engine
        core on another machine never reads it)."""
        _typed("limit_mm_per_prompt", self.limit_mm_per_prompt, ModalityLimits)
        domains: Any = self.allowed_media_domains  # a CLI list, or one name
        given: tuple[object, ...] = (domains,) if isinstance(domains, str) else tuple(domains)
        if any(not isinstance(d, str) or not d.strip() or "/" in d for d in given):
            raise ValueError(f"allowed_media_domains must be host names, got {list(given)!r}")
        object.__setattr__(self, "allowed_media_domains", tuple(str(d).strip().lower() for d in given))
        _at_least(1, max_image_bytes=self.max_image_bytes, max_image_pixels=self.max_image_pixels)
        if self.max_image_pixels > PIL_MAX_IMAGE_PIXELS:
            raise ValueError(f"max_image_pixels must be <= {PIL_MAX_IMAGE_PIXELS} (PIL's own guard)")
        if not self.media_fetch_timeout > 0:
            raise ValueError(f"media_fetch_timeout must be > 0, got {self.media_fetch_timeout}")

    @property
    def max_images_per_prompt(self) -> int:
        """Images one prompt may carry."""
        limits = self.limit_mm_per_prompt
        return DEFAULT_MAX_IMAGES_PER_PROMPT if limits is None else limits.image


# The JSON sub-configs by flat name: each one's parser, JSON text or a mapping (or the typed config, as is) ->
# its typed config. `from_flat` runs it once, on what `LLM(**kwargs)` or a caller gives.
_SUB_CONFIG_PARSERS: dict[str, Callable[[Any], object]] = {
    "speculative_config": parse_speculative_config,
    "pooler_config": parse_pooler_config,
    "kv_events_config": parse_kv_events_config,
    "limit_mm_per_prompt": parse_limit_mm_per_prompt,
    "attention_ffn_disaggregation": parse_attention_ffn_config,
}


def _parsed_sub_configs(names: Mapping[str, object]) -> dict[str, object]:
    """`names` with each JSON sub-config's text or dict parsed into its typed config (None stays None: off)."""
    return {
        name: value if value is None or name not in _SUB_CONFIG_PARSERS else _SUB_CONFIG_PARSERS[name](value)
        for name, value in names.items()
    }


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What model runs, how, and what one prompt may be; None means "derive from the model or the machine"."""

    # HF folder, .gguf path or a packaged model's short name; None: the default (pagoda.server.packaged)
    model: str | None = None
    tokenizer: str | None = None  # a folder with the tokenizer's files; None: the model's own
    dtype: DTypeName = "auto"
    device: str | None = None  # "cuda" when available, else "cpu"
    kernel_backend: KernelBackendName = "auto"
    enforce_eager: bool = False  # CUDA: run the model's forward uncompiled (every step, prefill and decode)
    seed: int = 0
    cache_dir: str | None = None  # where converted GGUF models are cached
    # TGI's prompt cap: a longer prompt is a 400. None: max_model_len - 1.
    max_input_tokens: int | None = None
    # Weights of a .gguf: None (the default) or "gguf" keeps its block formats, "none" dequantizes them (measured
    # on a 2-core Sapphire Rapids: the kept blocks serve one stream 1.5x faster, a 64 x 128 batch as fast, in 0.28x
    # the memory). Safetensors: none, int8 or int4.
    quantization: QuantizationName | None = None
    # int4's weights per float16 scale and minimum: 32, 64 or 128; None: 128.
    quantization_group_size: int | None = None
    # --runner (vLLM's; --task embed is its older alias): generate serves completions and chat, pooling serves
    # /v1/embeddings, /score and /rerank (pagoda.server.pooling).
    runner: RunnerName = "generate"
    # --pooler-config (vLLM's): the pooling runner's pooling type and normalisation; None: LAST, normalised. A dict
    # (LLM(pooler_config={...})) is taken as the flag's JSON object, parsed by from_flat.
    pooler_config: PoolerConfig | None = None
    # --enable-sleep-mode (vLLM's; pagoda.server.engine.sleep): the engine may sleep (free its KV pool and weights'
    # memory) and wake; the server's /sleep, /wake_up and /is_sleeping answer 404 without it.
    enable_sleep_mode: bool = False

    def __post_init__(self) -> None:
        """ValueError naming the field."""
        _at_least(1, max_input_tokens=self.max_input_tokens)
        _one_of("runner", self.runner, get_args(RunnerName))
        _typed("pooler_config", self.pooler_config, PoolerConfig)
        if self.quantization is not None:
            _one_of("quantization", self.quantization, get_args(QuantizationName))
        if self.quantization == "gguf" and not self.is_gguf():
            raise ValueError(
                f"quantization 'gguf' needs a .gguf model (or a packaged model), not {self.model!r}; "
                "a safetensors folder loads with quantization none, int8 or int4"
            )
        if self.quantization in ("int8", "int4") and self.is_gguf():
            raise ValueError(
                f"quantization {self.quantization!r} quantizes a safetensors checkpoint at load; a .gguf keeps its "
                "own block formats (quantization gguf) or is dequantized (none)"
            )
        if self.quantization_group_size is not None:
            if self.quantization != "int4":
                raise ValueError(
                    "quantization_group_size applies to quantization int4 (int8 uses Q8_0 blocks of 32), "
                    f"not to quantization {self.quantization}"
                )
            if self.quantization_group_size not in INT4_GROUP_SIZES:
                raise ValueError(
                    f"quantization_group_size must be one of {INT4_GROUP_SIZES}, not {self.quantization_group_size}"
                )
        _one_of("dtype", self.dtype, get_args(DTypeName))
        _one_of("kernel_backend", self.kernel_backend, get_args(KernelBackendName))

    def is_gguf(self) -> bool:
        """Whether the model is a .gguf file (every packaged model, the default among them, is one)."""
        return packaged_model(self.model) is not None or str(self.model).endswith(".gguf")

    def keeps_quantized(self) -> bool:
        """Whether a .gguf's block formats stay quantized in the layers (`quantization` gguf, the default for one)."""
        return self.quantization in ("gguf", None) and self.is_gguf()

    def quantizes_at_load(self) -> bool:
        """Whether a safetensors checkpoint's weights are quantized at load (`quantization` int8 or int4)."""
        return self.quantization in ("int8", "int4")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The KV cache: block size, its size on the device and the host, and how sequences reserve it."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of total GPU memory the engine may use
    kv_cache_gib: float = 4.0  # CPU: KV cache size
    swap_space_gib: float = 4.0  # host tier for preemption by swap
    num_kv_blocks: int | None = None  # override the computed KV capacity (tests use tiny pools)
    kv_manager: KVManagerName = "paged"
    kv_cache_dtype: KVCacheDtypeName = "auto"  # the KV cache's storage dtype
    # vLLM's flag: one full-attention group of every layer (today's layout) instead of KV cache groups.
    disable_hybrid_kv_cache_manager: bool = False
    # --kv-events-config (vLLM's JSON; pagoda.server.kv_events): KV cache events published; None: off.
    kv_events_config: KVEventsConfig | None = None
    # KV tiers (pagoda.server.kv_tiers): a host tier of this many GiB, shared by the replicas on a host; None: off.
    kv_offloading_size: float | None = None
    kv_offloading_backend: KVOffloadingBackendName = "native"
    # A disk tier under this folder, bounded by kv_offloading_disk_size GiB; None: off.
    kv_offloading_disk_path: str | None = None
    kv_offloading_disk_size: float | None = None
    # The host tier's shared-memory file, chosen by the server so that it outlives an engine core; None: the
    # engine makes a private one (and removes it at close). Not a flag.
    kv_offloading_shm: str | None = None

    def __post_init__(self) -> None:
        """ValueError naming the field."""
        _typed("kv_events_config", self.kv_events_config, KVEventsConfig)
        _at_least(1, block_size=self.block_size, num_kv_blocks=self.num_kv_blocks)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        _at_least(0, swap_space_gib=self.swap_space_gib)
        _one_of("kv_manager", self.kv_manager, get_args(KVManagerName))
        _one_of("kv_cache_dtype", self.kv_cache_dtype, get_args(KVCacheDtypeName))
        _one_of("kv_offloading_backend", self.kv_offloading_backend, get_args(KVOffloadingBackendName))
        for name, size in (
            ("kv_offloading_size", self.kv_offloading_size),
            ("kv_offloading_disk_size", self.kv_offloading_disk_size),
        ):
            if size is not None and not 0 < size < float("inf"):
                raise ValueError(f"{name} must be a positive number of GiB, got {size}")
        if (self.kv_offloading_disk_path is None) != (self.kv_offloading_disk_size is None):
            raise ValueError("kv_offloading_disk_path and kv_offloading_disk_size go together")
        if (self.kv_offloading_size is not None or self.kv_offloading_disk_path is not None) and (
            self.kv_manager != "paged"
        ):
            raise ValueError(
                "kv_offloading_size needs kv_manager paged: tiers are found by prefix-cache keys"
            )

    @property
    def kv_tiers_enabled(self) -> bool:
        """Whether a host or disk KV tier is configured."""
        return self.kv_offloading_size is not None or self.kv_offloading_disk_path is not None


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How one engine's model is split: tensor-parallel ranks, and where the processes beyond the first run."""

    tensor_parallel_size: int = 1  # ranks one model's layers are split over
    distributed_executor_backend: DistributedExecutorBackendName = "mp"
    data_parallel_rank: int | None = None  # an engine core's place among the replicas (set by CoreClient)
    # --attention-ffn-disaggregation (engine/executor/afd.py): attention and MLP on separate ranks; None: off.
    attention_ffn_disaggregation: AttentionFFNConfig | None = None

    def __post_init__(self) -> None:
        """ValueError naming the field."""
        _at_least(1, tensor_parallel_size=self.tensor_parallel_size)
        _typed("attention_ffn_disaggregation", self.attention_ffn_disaggregation, AttentionFFNConfig)
        if self.attention_ffn_disaggregation is not None and self.tensor_parallel_size > 1:
            raise ValueError(
                f"{AFD_FLAG} runs with tensor_parallel_size 1 (its ranks are the attention and FFN workers), "
                f"got {self.tensor_parallel_size}"
            )
        _one_of(
            "distributed_executor_backend",
            self.distributed_executor_backend,
            get_args(DistributedExecutorBackendName),
        )


DEFAULT_GRAMMAR_CACHE_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class StructuredOutputsConfig:
    """Structured outputs in the engine: the compiled-grammar cache's bound, and the per-row mask deadline."""

    # xgrammar's compiled-grammar cache (its cache_limit_bytes): least recently used grammars leave beyond it.
    grammar_cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES
    # Seconds a step waits for a row's token mask; a row not filled by then aborts its request alone.
    grammar_fill_timeout: float = 1.0

    def __post_init__(self) -> None:
        """ValueError naming the field."""
        _at_least(1024 * 1024, grammar_cache_bytes=self.grammar_cache_bytes)
        if self.grammar_fill_timeout <= 0:
            raise ValueError(f"grammar_fill_timeout must be > 0, got {self.grammar_fill_timeout}")


@dataclass(frozen=True, slots=True)
class LoRAModulePath:
    """One `--lora-modules` entry: an adapter served under `name` from the PEFT folder `path`."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoRAModulePath:
        """`name=path` or vLLM's JSON `{"name": ..., "path": ..., "base_model_name": ...}`; ValueError if neither."""
        if text.lstrip().startswith("{"):
            try:
                spec = json.loads(text)
            except ValueError as exc:
                raise ValueError(f"lora_modules: {text!r} is not valid JSON ({exc})") from exc
            if not isinstance(spec, dict) or set(spec) - {"name", "path", "base_model_name"}:
                raise ValueError(f"lora_modules: {text!r} takes the keys name, path and base_model_name")
            name, path, base = spec.get("name"), spec.get("path"), spec.get("base_model_name")
            if not isinstance(name, str) or not isinstance(path, str) or not isinstance(base, str | None):
                raise ValueError(f"lora_modules: {text!r} needs string name and path")
            return cls(name, path, base)
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"lora_modules: {text!r} is neither name=path nor a JSON object")
        return cls(name, path)


def _runtime_lora_updating_from_env() -> bool:
    """vLLM's switch: VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (or 1) enables the load/unload endpoints."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in {"1", "true"}


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's flags); the per-step adapter cap is the scheduler's `max_loras`."""

    enable_lora: bool = False
    lora_modules: tuple[LoRAModulePath, ...] = ()  # adapters served from the start
    max_lora_rank: int = 16  # the slot pool's rank: an adapter of a higher rank is refused
    max_cpu_loras: int | None = None  # adapters kept loaded (LRU beyond); None: max_loras
    allow_runtime_lora_updating: bool = field(default_factory=_runtime_lora_updating_from_env)

    def __post_init__(self) -> None:
        """ValueError naming the field."""
        modules = tuple(
            m if isinstance(m, LoRAModulePath) else LoRAModulePath.parse(str(m)) for m in self.lora_modules
        )
        object.__setattr__(self, "lora_modules", modules)  # a CLI list, or name=path strings
        _at_least(1, max_lora_rank=self.max_lora_rank, max_cpu_loras=self.max_cpu_loras)
        names = [m.name for m in modules]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules: an adapter name is given twice ({', '.join(names)})")
        if modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")


def _server_scheduler_config() -> SchedulerConfig:
    """The scheduler section with the model-derived limits left to the engine (None)."""
    return SchedulerConfig(max_model_len=None, max_num_batched_tokens=None)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything needed to build an engine (sent as is to engine-core processes and tensor-parallel workers).

    `scheduler_config` is the scheduler's own section: its `max_model_len` (None: the model's, capped at 8192)
    and `max_num_batched_tokens` (None: 2048 with chunked prefill, else max(2048, max_model_len)) are filled
    by the engine once it has loaded the model.
    """

    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=_server_scheduler_config)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)
    multimodal_config: MultiModalConfig = field(default_factory=MultiModalConfig)  # images (issue 38)
    # --speculative-config (vLLM's JSON; pagoda.server.spec): drafts verified in one pass; None: off.
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        """ValueError naming the field."""
        _typed("speculative_config", self.speculative_config, SpeculativeConfig)
        afd = self.parallel_config.attention_ffn_disaggregation
        if afd is not None and self.model_config.runner == "pooling":
            raise ValueError(f"{AFD_FLAG} runs the generate runner only, not --runner pooling")

    @classmethod
    def from_flat(cls, **names: object) -> EngineConfig:
        """The config of flat field names (`max_num_seqs=8, block_size=4, ...`); TypeError naming an unknown one.
        A JSON sub-config may be given as JSON text or a dict (parsed here, once) or as its typed config."""
        return build_config(cls(), _parsed_sub_configs(names))


@dataclass(frozen=True, slots=True)
class CoreClientConfig:
    """Where the engine steps: on a thread of the server (inproc) or in engine-core processes, data-parallel."""

    engine_core: EngineCoreName = "inproc"
    data_parallel_size: int = 1  # engine-core replicas behind one router (> 1 implies engine_core "process")
    routing_policy: RoutingPolicyName = "cache_aware"
    engine_ready_timeout: float = 600.0  # seconds a core may take to load its model
    replica_send_hwm: int = 1000  # frames queued for one core before sends to it stop (ZeroMQ's SNDHWM)
    replica_stall_timeout: float = 30.0  # seconds a core may stay full before it is treated as sick
    routing_kv_events: bool = False  # the cache_aware router follows the cores' KV cache events (no guessing)
    # Per engine core in index order, the CPUs its threads run on (None: the launcher's automatic split).
    replica_cpus: tuple[tuple[int, ...], ...] | None = None
    # Prefill/decode disaggregation (core/disagg.py): this many cores prefill, then this many decode; they are
    # the data_parallel_size cores (0 and 0: every core does both).
    prefill_replicas: int = 0
    decode_replicas: int = 0
    # How decode cores get a prefill core's blocks: the host tier the cores of one machine share ("shm"), or pulled
    # over TCP from the prefill core's block server ("tcp": cores on other hosts, each with a tier of its own).
    kv_transfer: KVTransferName = "shm"

    def __post_init__(self) -> None:
        """ValueError naming the field."""
        self._check_disaggregation()
        _one_of("kv_transfer", self.kv_transfer, get_args(KVTransferName))
        if self.kv_transfer == "tcp" and not self.prefill_replicas:
            raise ValueError(
                "kv_transfer tcp moves blocks between prefill and decode cores: set prefill_replicas"
            )
        _at_least(1, data_parallel_size=self.data_parallel_size, replica_send_hwm=self.replica_send_hwm)
        if self.replica_cpus is not None:
            self._check_replica_cpus(self.replica_cpus)
        if self.engine_ready_timeout <= 0:
            raise ValueError(f"engine_ready_timeout must be > 0, got {self.engine_ready_timeout}")
        if self.replica_stall_timeout <= 0:
            raise ValueError(f"replica_stall_timeout must be > 0, got {self.replica_stall_timeout}")
        if self.routing_kv_events and self.routing_policy != "cache_aware":
            raise ValueError("routing_kv_events needs routing_policy cache_aware")
        if self.routing_kv_events and self.in_process:
            raise ValueError(
                "routing_kv_events needs engine-core replicas (data_parallel_size or engine_core)"
            )
        _one_of("engine_core", self.engine_core, get_args(EngineCoreName))

    def _check_disaggregation(self) -> None:
        """Both counts or neither; data_parallel_size is their sum (set from them when left at 1)."""
        prefill, decode = self.prefill_replicas, self.decode_replicas
        if prefill < 0 or decode < 0:
            raise ValueError(f"prefill_replicas and decode_replicas must be >= 0, got {prefill} and {decode}")
        if not prefill and not decode:
            return
        if not prefill or not decode:
            raise ValueError("prefill_replicas and decode_replicas go together: at least one core of each")
        if self.data_parallel_size == 1:
            object.__setattr__(self, "data_parallel_size", prefill + decode)
        elif self.data_parallel_size != prefill + decode:
            raise ValueError(
                f"data_parallel_size {self.data_parallel_size} is not prefill_replicas + decode_replicas "
                f"({prefill} + {decode}): leave it out"
            )

    @property
    def disaggregated(self) -> bool:
        """Whether prefill and decode run on separate engine cores."""
        return self.prefill_replicas > 0

    @property
    def in_process(self) -> bool:
        """True when the engine runs in the server's own process (one replica, no core process)."""
        return self.engine_core == "inproc" and self.data_parallel_size == 1

    def _check_replica_cpus(self, cpus: tuple[tuple[int, ...], ...]) -> None:
        """One non-empty list per engine core, of CPUs this process may run on."""
        if self.in_process:
            raise ValueError(
                "replica_cpus pins engine-core processes: set engine_core process or data_parallel_size"
            )
        if len(cpus) != self.data_parallel_size:
            raise ValueError(
                f"replica_cpus has {len(cpus)} entries for data_parallel_size {self.data_parallel_size} engine cores"
            )
        allowed = os.sched_getaffinity(0)
        for index, entry in enumerate(cpus):
            if not entry:
                raise ValueError(f"replica_cpus entry {index} names no CPU")
            outside = sorted(set(entry) - allowed)
            if outside:
                raise ValueError(
                    f"replica_cpus entry {index} names CPU {outside[0]}, which this process cannot run on "
                    f"(allowed: {','.join(map(str, sorted(allowed)))})"
                )


_PROMETHEUS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Sequences waiting for their first token before new requests get a 429: two requests at the default
# --max-sequences-per-request (so one always fits an idle server), 16 times the default --max-num-seqs. Waiting
# sequences hold no KV but hold their prompts and state, and each wait costs the ones behind it.
DEFAULT_MAX_WAITING_REQUESTS = 4096
# The host tier a prefill core's blocks wait in for a decode core when --kv-offloading-size is not given.
DEFAULT_HANDOFF_TIER_GIB = 1.0
# A reader that leaves a snapshot of its stream unread this long (seconds) is aborted, freeing its KV.
DEFAULT_STREAM_STALL_TIMEOUT = 30.0


@dataclass(frozen=True, slots=True)
class ServingConfig:
    """`AsyncLLM`'s admission limits and names (the asynchronous front of the engine)."""

    served_model_name: str | None = None  # the model name in the API; None: the engine's model name
    # 429 when a request's sequences (prompts x n) and those waiting for their first token would exceed this.
    max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS  # None: no limit
    max_concurrent_requests: int | None = None  # TGI's limit on requests (prompts) in flight
    metrics_prefix: str = DEFAULT_METRICS_PREFIX
    on_engine_failure: EngineFailureName = "restart"  # an in-process engine whose step raised
    stream_stall_timeout: float | None = DEFAULT_STREAM_STALL_TIMEOUT  # None: never abort a slow reader
    # Sleep mode (needs enable_sleep_mode): a request to a sleeping engine wakes it instead of getting a 503.
    wake_on_request: bool = False
    # llama.cpp's --sleep-idle-seconds: sleep (level 1) after this many seconds without a request; implies
    # enable_sleep_mode and wake_on_request (the next request wakes the engine, as llama.cpp reloads its model).
    sleep_idle_seconds: float | None = None  # None: never

    def __post_init__(self) -> None:
        """ValueError naming the field."""
        _at_least(
            1,
            max_waiting_requests=self.max_waiting_requests,
            max_concurrent_requests=self.max_concurrent_requests,
        )
        if self.sleep_idle_seconds is not None and not self.sleep_idle_seconds > 0:
            raise ValueError(f"sleep_idle_seconds must be > 0, got {self.sleep_idle_seconds}")
        _one_of("on_engine_failure", self.on_engine_failure, get_args(EngineFailureName))
        if _PROMETHEUS_NAME.fullmatch(self.metrics_prefix) is None:
            raise ValueError(
                "metrics_prefix must be a Prometheus name: letters, digits and _, not a digit first"
            )
        if self.stream_stall_timeout is not None and not self.stream_stall_timeout > 0:
            raise ValueError(f"stream_stall_timeout must be > 0, got {self.stream_stall_timeout}")


# OpenAI's cap on the prompt array of one completion request; sequences (prompts x n) are capped at the same
# number by default, so that a small body cannot fan out into more engine work than a full prompt array.
DEFAULT_MAX_PROMPTS_PER_REQUEST = 2048
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 2048
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """How much fan-out one HTTP request may ask for (--max-prompts-per-request, --max-sequences-per-request)."""

    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST

    def __post_init__(self) -> None:
        """ValueError naming the field."""
        _at_least(
            1,
            max_prompts_per_request=self.max_prompts_per_request,
            max_sequences_per_request=self.max_sequences_per_request,
        )


@dataclass(frozen=True, slots=True)
class AppSettings:
    """The API app's options (`pagoda.server.api.build_app`)."""

    # --api-key: one key, or several (the flag repeated); each caller presents one of them (or of api_key_file).
    api_key: str | tuple[str, ...] | None = None
    api_key_file: str | None = None  # --api-key-file: one key per line (blank lines and `#` comments skipped)
    # --admin-api-key (repeatable): keys accepted everywhere, and the only ones that may load or unload LoRA
    # adapters at run time, see adapters' folders in /v1/models and every tenant's requests on the dashboard.
    admin_api_key: str | tuple[str, ...] | None = None
    # --[no-]isolate-prefix-cache-per-key: a key's requests share cached prefixes only with that key's.
    isolate_prefix_cache_per_key: bool = True
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # --max-request-body-bytes: 413 for larger bodies
    limits: RequestLimits = field(default_factory=RequestLimits)
    # The chat template's text, overriding the tokenizer's (the CLI loads --chat-template's file into it).
    chat_template: str | None = None
    reasoning_parser: ReasoningParserName | None = None  # --reasoning-parser
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice: tool_choice "auto" needs it
    tool_call_parser: ToolParserName | None = None  # --tool-call-parser
    # Longest regex, grammar, JSON schema (as canonical JSON text) or choice grammar a request may send: else 400.
    # 16 Ki (issue 43): the costliest text per character (adjacent character classes, `[a-z]` x N) compiled for
    # 2.2-3.7 s at 16 k characters on a busy 2-core Zen 4 against a 49k vocabulary, 20 s at 120 k; legitimate
    # JSON schemas cost far less (a 17 k-character one of 100 nested objects: 0.07 s).
    max_grammar_chars: int = 16 * 1024
    # Seconds the API waits for a constraint to compile before answering 400 (the compile runs on, dropped).
    grammar_compile_timeout: float = 5.0
    # --max-stored-responses: /v1/responses kept for previous_response_id and GET, per API key (LRU beyond it).
    max_stored_responses: int = 1024
    # --max-stored-response-bytes: the bytes (as JSON) of the responses one API key may keep stored.
    max_stored_response_bytes: int = 64 * 1024 * 1024
    # --[no-]disable-any-whitespace: grammar-forced JSON (response_format json_schema, required and named tool
    # calls) has no whitespace runs outside strings; off restores free (bounded) whitespace.
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        """ValueError naming the field."""
        _at_least(1, max_body_bytes=self.max_body_bytes, max_grammar_chars=self.max_grammar_chars)
        _at_least(0, max_stored_responses=self.max_stored_responses)
        _at_least(1, max_stored_response_bytes=self.max_stored_response_bytes)
        if self.grammar_compile_timeout <= 0:
            raise ValueError(f"grammar_compile_timeout must be > 0, got {self.grammar_compile_timeout}")
        for name in ("api_key", "admin_api_key"):
            given: object = getattr(self, name)
            if isinstance(given, list):  # argparse's `append` gives a list; the section stays hashable
                object.__setattr__(self, name, tuple(given))
        self.api_keys()  # ValueError naming api_key or api_key_file
        self.admin_api_keys()  # ValueError naming admin_api_key
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice requires tool_call_parser")

    def api_keys(self) -> tuple[str, ...]:
        """Every accepted key: api_key's and api_key_file's lines; empty when the API is open."""
        given = (self.api_key,) if isinstance(self.api_key, str) else tuple(self.api_key or ())
        if any(not key.strip() for key in given):
            raise ValueError("api_key must not be empty")
        if self.api_key_file is None:
            return tuple(key.strip() for key in given)
        try:
            lines = Path(self.api_key_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"api_key_file {self.api_key_file!r} cannot be read: {exc}") from exc
        from_file = tuple(
            line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")
        )
        if not from_file:
            raise ValueError(f"api_key_file {self.api_key_file!r} holds no key")
        return tuple(key.strip() for key in given) + from_file

    def admin_api_keys(self) -> tuple[str, ...]:
        """The admin keys (each also accepted wherever an API key is); empty when there is none."""
        given = (
            (self.admin_api_key,) if isinstance(self.admin_api_key, str) else tuple(self.admin_api_key or ())
        )
        if any(not key.strip() for key in given):
            raise ValueError("admin_api_key must not be empty")
        return tuple(key.strip() for key in given)


@dataclass(frozen=True, slots=True)
class HTTPLimits:
    """Bounds on what one HTTP request may take before the app sees it."""

    # Request line + header lines, in bytes: 414 if the request line alone is longer, else 431.
    max_head_bytes: int = 16 * 1024
    # Seconds from the connection opening (or the previous response ending) to a complete head: then 408.
    head_timeout: float = 10.0
    # Seconds the body may go without a byte arriving (an idle gap, so slow uploads that progress never time out).
    body_timeout: float = 30.0
    # Seconds a whole body may take however it trickles (beside the idle gap): then 408. 60 (issue 43): a body
    # dribbled a byte per idle gap holds its connection a minute at most; the largest body (--max-request-body-
    # bytes, 4 MiB) needs only ~0.6 Mbit/s to arrive in time.
    body_deadline: float = 60.0
    # uvicorn's --limit-concurrency: open connections (and tasks) beyond it get a 503. None: no cap.
    limit_concurrency: int | None = None

    def __post_init__(self) -> None:
        """ValueError naming the field."""
        _at_least(1024, max_head_bytes=self.max_head_bytes)
        _at_least(1, limit_concurrency=self.limit_concurrency)
        for name in ("head_timeout", "body_timeout", "body_deadline"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


DEFAULT_SHUTDOWN_TIMEOUT = 30.0


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The HTTP server (`pagoda.server.api.server.run_server`): address, drain time, logs, HTTP limits."""

    host: str = "127.0.0.1"
    port: int = 8000
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT  # seconds in-flight requests may run after SIGTERM
    log_level: LogLevelName = "info"
    limits: HTTPLimits = field(default_factory=HTTPLimits)

    def __post_init__(self) -> None:
        """ValueError naming the field."""
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        _at_least(0, shutdown_timeout=self.shutdown_timeout)
        _one_of("log_level", self.log_level, get_args(LogLevelName))


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """Everything `pagoda serve` runs: the engine part and one section per consumer in front of it."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    core: CoreClientConfig = field(default_factory=CoreClientConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)
    app: AppSettings = field(default_factory=AppSettings)
    server: ServerConfig = field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        """ValueError naming the fields of two sections that do not go together."""
        serving, model = self.serving, self.engine.model_config
        if serving.sleep_idle_seconds is not None and not (
            model.enable_sleep_mode and serving.wake_on_request
        ):
            # llama.cpp's flag alone: the idle engine sleeps and the next request wakes it.
            engine = replace(self.engine, model_config=replace(model, enable_sleep_mode=True))
            object.__setattr__(self, "engine", engine)
            object.__setattr__(self, "serving", replace(serving, wake_on_request=True))
        elif serving.wake_on_request and not model.enable_sleep_mode:
            raise ValueError("wake_on_request needs enable_sleep_mode")
        if (
            self.core.replica_cpus is not None
            and self.engine.parallel_config.distributed_executor_backend == "ray"
        ):
            raise ValueError(
                "replica_cpus pins local processes; Ray places its actors (distributed_executor_backend)"
            )
        if self.core.disaggregated:
            self._check_disaggregation()
        if self.core.routing_kv_events:
            events = self.engine.cache_config.kv_events_config
            if events is None or not events.enable_kv_cache_events or events.publisher != "zmq":
                raise ValueError(
                    "routing_kv_events needs kv_events_config with enable_kv_cache_events and the zmq publisher"
                )

    def _check_disaggregation(self) -> None:
        """The KV moves through the host tier the cores of this host share: one host, prefix caching on, and a
        host tier (DEFAULT_HANDOFF_TIER_GIB when --kv-offloading-size is not given)."""
        engine = self.engine
        if engine.parallel_config.distributed_executor_backend == "ray" and self.core.kv_transfer != "tcp":
            raise ValueError(
                "prefill_replicas with distributed_executor_backend ray needs kv_transfer tcp: Ray may place the "
                "cores on other machines, where no shared-memory tier reaches"
            )
        if not engine.scheduler_config.enable_prefix_caching:
            raise ValueError(
                "prefill_replicas needs enable_prefix_caching: a decode core finds the prefill's blocks through it"
            )
        cache = engine.cache_config
        if cache.kv_offloading_size is None:
            cache = replace(cache, kv_offloading_size=DEFAULT_HANDOFF_TIER_GIB)
            object.__setattr__(self, "engine", replace(engine, cache_config=cache))

    @classmethod
    def from_flat(cls, **names: object) -> ServeConfig:
        """The config of flat field names; TypeError naming an unknown one. A JSON sub-config may be given as JSON
        text or a dict (parsed here, once) or as its typed config (the CLI's flag types parse it)."""
        return build_config(cls(), _parsed_sub_configs(names))


def resolved_scheduler_config(
    config: SchedulerConfig, *, max_model_len: int, max_num_batched_tokens: int, kv_manager: KVManagerName
) -> SchedulerConfig:
    """The scheduler section with the engine's derived limits filled in (contiguous KV shares no prefix)."""
    return replace(
        config,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=config.enable_prefix_caching and kv_manager == "paged",
    )
