"""The argument table of `pagoda serve` and the one config it builds (`ServeConfig`).

Each flag's destination is a field name of the config tree (`pagoda.server.config`): its default comes from
that field and `--help` lists it under that field's section. A new flag is one row here plus its field;
TGI's aliases are rows that name the vLLM destination they set. The JSON sub-config flags (--speculative-config,
--pooler-config, --kv-events-config) are parsed by their argparse types, once, into the typed configs the tree holds.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import reduce
from pathlib import Path
from typing import Any, get_args

from pagoda.scheduler import PreemptionMode, SchedulingPolicyName, SchedulingProfileName
from pagoda.server.afd_config import AttentionFFNConfig, parse_attention_ffn_config
from pagoda.server.config import (
    DEFAULT_MAX_IMAGES_PER_PROMPT,
    INT4_GROUP_SIZES,
    PIL_MAX_IMAGE_PIXELS,
    DistributedExecutorBackendName,
    DTypeName,
    EngineConfig,
    EngineCoreName,
    EngineFailureName,
    KernelBackendName,
    KVCacheDtypeName,
    KVManagerName,
    KVOffloadingBackendName,
    KVTransferName,
    LogLevelName,
    ModalityLimits,
    QuantizationName,
    ReasoningParserName,
    ServeConfig,
    ToolParserName,
    parse_limit_mm_per_prompt,
)
from pagoda.server.config_tree import flat_names
from pagoda.server.kv_events.config import KVEventsConfig, parse_kv_events_config
from pagoda.server.packaged import model_help
from pagoda.server.pooling.params import PoolerConfig, PoolerConfigError, RunnerName, parse_pooler_config
from pagoda.server.routing import RoutingPolicyName
from pagoda.server.spec.config import SpeculativeConfig, parse_speculative_config


@dataclass(frozen=True, slots=True)
class Flag:
    """One row of the table: argparse's option strings and keywords; `alias_of` for a TGI alias."""

    options: tuple[str, ...]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    alias_of: str | None = None  # the destination (field) this alias sets; None: the flag's own dest is one

    @property
    def dest(self) -> str:
        """The namespace attribute: the field name (or, for an alias, its own name)."""
        explicit = self.kwargs.get("dest")
        return str(explicit) if explicit else self.options[0].lstrip("-").replace("-", "_")


class _Given(argparse.Action):
    """Store the value and record the flag as given, so that a TGI alias can conflict with it."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        """Set the destination and add it to `namespace.given`."""
        setattr(namespace, self.dest, values)
        namespace.given = {*getattr(namespace, "given", ()), self.dest}


# --task's values (vLLM's older flag) -> the --runner they select.
_TASK_RUNNERS: dict[str, RunnerName] = {
    "generate": "generate",
    "embed": "pooling",
    "embedding": "pooling",
    "score": "pooling",  # issue 42: /score and /rerank
}


def task_runner(text: str) -> RunnerName:
    """The runner of a --task value; argparse's error (exit 2) naming the flag for another."""
    runner = _TASK_RUNNERS.get(text)
    if runner is None:
        raise argparse.ArgumentTypeError(f"invalid choice {text!r} (choose from {', '.join(_TASK_RUNNERS)})")
    return runner


def pooler_config_flag(text: str) -> PoolerConfig:
    """--pooler-config's JSON as a PoolerConfig; argparse's error (exit 2) naming the bad key."""
    try:
        return parse_pooler_config(text)
    except PoolerConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def argument_table() -> list[Flag]:
    """Every `pagoda serve` flag (vLLM's names where the meaning is the same; TGI's as aliases)."""
    given: dict[str, Any] = {"action": _Given}
    return [
        Flag(("model",), {"nargs": "?", "help": model_help()}),
        # model
        Flag(("--tokenizer",), {"help": "folder of the tokenizer's files (default: the model's own)"}),
        Flag(("--enforce-eager",), {"action": "store_true", "help": "CUDA: skip torch.compile"}),
        Flag(("--kernel-backend",), {"choices": get_args(KernelBackendName)}),
        Flag(("--dtype",), {"choices": get_args(DTypeName)}),
        Flag(
            ("--quantization", "-q"),
            {
                "choices": get_args(QuantizationName),
                "help": "a .gguf's weights: gguf keeps its block formats (default), none dequantizes them; "
                "int8 / int4: a safetensors model's weights quantized at load (Q8_0 blocks of 32; int4 groups "
                "of --quantization-group-size)",
            },
        ),
        Flag(
            ("--quantization-group-size",),
            {
                "type": int,
                "choices": INT4_GROUP_SIZES,
                "help": "--quantization int4: weights per float16 scale and minimum (default: 128)",
            },
        ),
        Flag(("--seed",), {"type": int, "help": "engine seed for requests without their own"}),
        Flag(
            ("--runner",),
            {
                "choices": get_args(RunnerName),
                **given,
                "help": "generate: completions and chat; pooling: /v1/embeddings (prompts pooled into vectors), "
                "/score and /rerank (a cross-encoder, or cosines of embeddings)",
            },
        ),
        Flag(
            ("--task",),
            {
                "type": task_runner,
                "metavar": "{generate,embed,score}",
                "help": "vLLM's older name of --runner",
            },
            "runner",
        ),
        Flag(
            ("--pooler-config",),
            {
                "type": pooler_config_flag,
                "metavar": "JSON",
                "help": 'the pooling runner\'s pooler, e.g. \'{"pooling_type": "MEAN", "normalize": true}\' '
                "(pooling_type LAST (default), MEAN or CLS; normalize default true)",
            },
        ),
        Flag(
            ("--enable-sleep-mode",),
            {
                "action": "store_true",
                "help": "serve POST /sleep?level=1|2 (free the KV pool and the weights' memory), POST /wake_up and "
                "GET /is_sleeping",
            },
        ),
        Flag(
            ("--max-input-tokens",),
            {
                "type": int,
                **given,
                "help": "longest prompt in tokens; a longer one is a 400 (default: --max-model-len - 1)",
            },
        ),
        Flag(
            ("--max-input-length",),
            {"type": int, "help": "TGI's older name of --max-input-tokens"},
            "max_input_tokens",
        ),
        # cache
        Flag(("--block-size",), {"type": int, "help": "tokens per KV-cache block"}),
        Flag(
            ("--gpu-memory-utilization",),
            {"type": float, "help": "CUDA: fraction of GPU memory the engine may use"},
        ),
        Flag(("--kv-cache-gib",), {"type": float, "help": "CPU: KV-cache size in GiB"}),
        Flag(
            ("--kv-offloading-size",),
            {
                "type": float,
                "metavar": "GIB",
                "help": "a host KV tier of this many GiB: computed prefix blocks are kept there and loaded back "
                "on a hit beyond the KV pool (CPU: shared memory, shared by every replica on the host)",
            },
        ),
        Flag(
            ("--kv-offloading-backend",),
            {"choices": get_args(KVOffloadingBackendName), "help": "the KV tiers' connector (vLLM's flag)"},
        ),
        Flag(
            ("--kv-offloading-disk-path",),
            {
                "metavar": "DIR",
                "help": "a disk KV tier in this folder (created 0700), kept across restarts",
            },
        ),
        Flag(
            ("--kv-offloading-disk-size",),
            {"type": float, "metavar": "GIB", "help": "the disk tier's bound in GiB (everything under DIR)"},
        ),
        Flag(
            ("--swap-space",),
            {
                "dest": "swap_space_gib",
                "metavar": "SWAP_SPACE",
                "type": float,
                "help": "host swap space in GiB (preemption by swap)",
            },
        ),
        Flag(
            ("--kv-manager",),
            {
                "choices": get_args(KVManagerName),
                "help": "paged: blocks on demand; contiguous: each sequence reserves --max-model-len tokens at "
                "admission (no prefix caching, no swapping)",
            },
        ),
        Flag(
            ("--kv-cache-dtype",),
            {
                "choices": get_args(KVCacheDtypeName),
                "help": "KV-cache storage: auto = the model's dtype; int8 = a scale per block and KV head (half "
                "of bfloat16's bytes); fp8 (= fp8_e4m3), fp8_e5m2: CUDA only",
            },
        ),
        Flag(
            ("--disable-hybrid-kv-cache-manager",),
            {
                "action": "store_true",
                "help": "keep every layer's KV for every position (one block table for all layers) instead of "
                "KV cache groups whose sliding-window layers keep only their window",
            },
        ),
        Flag(
            ("--kv-events-config",),
            {
                "type": _kv_events_config,
                "metavar": "JSON",
                "help": "vLLM's KV cache events: a JSON object of enable_kv_cache_events, publisher (zmq), endpoint "
                "(tcp://127.0.0.1:5557), replay_endpoint, buffer_steps, hwm, max_queue_size, topic",
            },
        ),
        # scheduler
        Flag(
            ("--max-model-len",), {"type": int, **given, "help": "longest prompt + output (default: model's)"}
        ),
        Flag(
            ("--max-total-tokens",),
            {"type": int, "help": "prompt + output tokens of one request (--max-model-len)"},
            "max_model_len",
        ),
        Flag(("--max-num-batched-tokens",), {"type": int, "help": "token budget of one step"}),
        Flag(("--max-num-seqs",), {"type": int, **given, "help": "most sequences in one step"}),
        Flag(
            ("--max-batch-size",),
            {"type": int, "help": "most sequences in one step (--max-num-seqs)"},
            "max_num_seqs",
        ),
        Flag(
            ("--max-batch-prefill-tokens",),
            {
                "type": int,
                "help": "prefill tokens one step may compute (prompt chunks; decodes are not counted)",
            },
        ),
        Flag(
            ("--enable-prefix-caching",),
            {
                "action": argparse.BooleanOptionalAction,
                "help": "reuse the KV blocks of shared prompt prefixes",
            },
        ),
        Flag(
            ("--preemption-mode",),
            {
                "choices": get_args(PreemptionMode),
                "help": "auto: per victim, whichever of swap and recompute costs less on this machine (measured "
                "at start)",
            },
        ),
        Flag(
            ("--enable-chunked-prefill",),
            {
                "action": argparse.BooleanOptionalAction,
                "help": "split long prompts over steps, beside the running decodes",
            },
        ),
        Flag(
            ("--long-prefill-token-threshold",),
            {
                "type": int,
                "help": "cap on one request's prefill chunk in a step (default: only the step's budget)",
            },
        ),
        Flag(
            ("--max-num-partial-prefills",),
            {"type": int, "help": "requests that may be mid-prefill at once (default: no cap)"},
        ),
        Flag(
            ("--scheduling-policy",),
            {
                "choices": get_args(SchedulingPolicyName),
                "help": "fcfs: continuous batching in arrival order; priority: lower `priority` first; static: a "
                "batch of up to --max-num-seqs runs to completion and nobody joins it",
            },
        ),
        Flag(
            ("--scheduling-profile",),
            {
                "choices": get_args(SchedulingProfileName),
                "help": "presets of --max-num-batched-tokens, --max-num-seqs, the prefill chunk and prefix caching, "
                "scaled to the KV pool: throughput (16384, 512), latency (512, 32, chunk 256), balanced (8192, 128); "
                "adaptive: each step chooses its budget, chunk and batch from a cost model fitted on the steps it "
                "runs, to keep --slo-tpot-ms for running streams and --slo-ttft-ms for waiting prompts",
            },
        ),
        Flag(
            ("--slo-ttft-ms",),
            {
                "type": str,
                "metavar": "MS[,PRIORITY:MS...]",
                "help": "time-to-first-token objective in ms, per priority class after the default (e.g. 2000,0:300); "
                'a request\'s body may set its own ("slo": {"ttft_ms": ...})',
            },
        ),
        Flag(
            ("--slo-tpot-ms",),
            {
                "type": str,
                "metavar": "MS[,PRIORITY:MS...]",
                "help": "time-per-output-token objective in ms (as --slo-ttft-ms); adaptive without one keeps the TPOT "
                "the latency profile would give",
            },
        ),
        Flag(
            ("--static-batch-timeout",),
            {
                "dest": "static_batch_timeout_s",
                "metavar": "STATIC_BATCH_TIMEOUT",
                "type": float,
                "help": "static: seconds the oldest request waits for a full batch before a smaller one starts",
            },
        ),
        # parallel
        Flag(
            ("--tensor-parallel-size", "-tp"),
            {
                "type": int,
                "help": "split every layer over N ranks (gloo on CPU, NCCL on CUDA); N must divide the attention "
                "heads",
            },
        ),
        Flag(
            ("--distributed-executor-backend",),
            {
                "choices": get_args(DistributedExecutorBackendName),
                "help": "where the processes beyond the first run: mp: local processes; ray: Ray actors on the "
                "cluster of RAY_ADDRESS (or `ray start --head`), tensor-parallel ranks in a placement group",
            },
        ),
        Flag(
            ("--attention-ffn-disaggregation",),
            {
                "type": _attention_ffn_config,
                "metavar": "JSON",
                "help": 'attention/FFN disaggregation, {"attention_workers": A, "ffn_workers": F}: A attention '
                "ranks (the engine's process and A - 1 workers) hold the KV cache and run attention, split over "
                "the heads as --tensor-parallel-size A splits them, F FFN processes hold the MLP weights (split "
                "tensor-parallel when F > 1), activations cross every layer with two micro-batches in ping-pong "
                "(Llama family and Gemma 3; LoRA adapters on any projection; with --enable-sleep-mode every rank "
                "sleeps and wakes); None: off",
            },
        ),
        # engine cores
        Flag(
            ("--engine-core",),
            {
                "choices": get_args(EngineCoreName),
                "help": "inproc: the engine steps on a thread of the server's process; process: in an engine-core "
                "process of its own, over ZeroMQ (implied by --data-parallel-size > 1)",
            },
        ),
        Flag(
            ("--data-parallel-size",),
            {
                "type": int,
                "help": "engine-core replicas, each with its own model, KV cache and cores, behind one router",
            },
        ),
        Flag(
            ("--prefill-replicas",),
            {
                "type": int,
                "help": "disaggregated serving: this many engine cores compute prompts and first tokens, then hand "
                "each request to a decode core (with --decode-replicas; the KV moves through the shared host "
                "tier, 1 GiB unless --kv-offloading-size)",
            },
        ),
        Flag(
            ("--kv-transfer",),
            {
                "choices": get_args(KVTransferName),
                "help": "how decode cores get the prefill cores' KV blocks: shm (the host tier the cores of one "
                "machine share, the default) or tcp (pulled from the prefill core over CURVE-secured TCP: cores on "
                "other hosts, e.g. placed by Ray)",
            },
        ),
        Flag(
            ("--decode-replicas",),
            {
                "type": int,
                "help": "disaggregated serving: this many engine cores continue the requests the prefill cores "
                "hand over (with --prefill-replicas; cores are numbered prefill first)",
            },
        ),
        Flag(
            ("--replica-cpus",),
            {
                "type": parse_replica_cpus,
                "help": "the CPUs of each engine core, ';' between cores in index order, each a list of CPUs and "
                'ranges ("0;1", "0-3;4-7", "0,2;1,3"); each core\'s torch threads match its count and a '
                "restarted core keeps its list (default: the first CPU left to the front end, the rest split)",
            },
        ),
        Flag(
            ("--routing-policy",),
            {
                "choices": get_args(RoutingPolicyName),
                "help": "which replica serves a request: the one holding its prefix (cache_aware), the least "
                "loaded, or each in turn",
            },
        ),
        Flag(
            ("--routing-kv-events",),
            {
                "action": "store_true",
                "help": "cache_aware routing by the KV cache events of the replicas (subscribed on each one's "
                "--kv-events-config endpoint, which must enable zmq events) instead of an index of what was "
                "routed where",
            },
        ),
        Flag(
            ("--engine-ready-timeout",),
            {
                "type": float,
                "help": "seconds an engine core may take to load its model before the server gives up",
            },
        ),
        Flag(
            ("--replica-send-hwm",),
            {
                "type": int,
                "help": "frames the front end queues for one engine core before it stops sending to it "
                "(ZeroMQ's send high-water mark; sends never block)",
            },
        ),
        Flag(
            ("--replica-stall-timeout",),
            {
                "type": float,
                "help": "seconds an engine core may stay full (not reading its frames) before it is treated as "
                "sick: its requests fail with a 503 to retry and it is restarted",
            },
        ),
        # serving
        Flag(("--served-model-name",), {"help": "model name in the API (default: MODEL)"}),
        Flag(
            ("--max-waiting-requests",),
            {
                "type": int,
                "help": "429 when a request's sequences (prompts x n, or x the beam width) and those waiting "
                "for their first token would exceed this; 400 for a request that exceeds it alone",
            },
        ),
        Flag(
            ("--max-concurrent-requests",),
            {
                "type": int,
                "help": "429 when a request's prompts and those in flight would exceed this; 400 for one that "
                "exceeds it alone",
            },
        ),
        Flag(
            ("--metrics-prefix",),
            {"help": "namespace of the /metrics names (`vllm` for stock vLLM Grafana dashboards)"},
        ),
        Flag(
            ("--on-engine-failure",),
            {
                "choices": get_args(EngineFailureName),
                "help": "when the in-process engine's step raises: fail its requests with a 503 and rebuild it "
                "(restart, the default), exit non-zero for a supervisor (exit), or stay up answering 503, "
                "/health too (none)",
            },
        ),
        Flag(
            ("--stream-stall-timeout",),
            {
                "type": float,
                "help": "seconds a reader may leave a snapshot of its response unread before the request is "
                "aborted (its KV freed)",
            },
        ),
        Flag(
            ("--wake-on-request",),
            {
                "action": "store_true",
                "help": "sleep mode: a request to a sleeping engine wakes it (instead of a 503 with Retry-After)",
            },
        ),
        Flag(
            ("--sleep-idle-seconds",),
            {
                "type": float,
                "metavar": "N",
                "help": "sleep (level 1) after N seconds without a request; the next request wakes the engine "
                "(llama.cpp's flag; implies --enable-sleep-mode and --wake-on-request)",
            },
        ),
        # app
        Flag(
            ("--api-key",),
            {
                "action": "append",
                "help": "require `Authorization: Bearer <key>` (all but /health); repeat it for several keys",
            },
        ),
        Flag(("--api-key-file",), {"help": "file of accepted API keys, one per line (beside --api-key)"}),
        Flag(
            ("--admin-api-key",),
            {
                "action": "append",
                "help": "an admin key (repeatable; accepted like --api-key): only it loads and unloads LoRA "
                "adapters at run time, sees their folders in /v1/models and every tenant's dashboard rows",
            },
        ),
        Flag(
            ("--isolate-prefix-cache-per-key",),
            {
                "action": argparse.BooleanOptionalAction,
                "help": "with API keys, share cached prompt prefixes only among one key's requests",
            },
        ),
        Flag(
            ("--max-request-body-bytes",),
            {
                "dest": "max_body_bytes",
                "metavar": "MAX_REQUEST_BODY_BYTES",
                "type": int,
                "help": "413 for larger request bodies",
            },
        ),
        Flag(
            ("--chat-template",),
            {
                "help": "chat template for the chat endpoint, as a file path or the Jinja text (default: the "
                "tokenizer's)"
            },
        ),
        Flag(
            ("--reasoning-parser",),
            {
                "choices": get_args(ReasoningParserName),
                "help": "split <think> reasoning into the chat responses' reasoning_content (vLLM's names)",
            },
        ),
        Flag(
            ("--enable-auto-tool-choice",),
            {
                "action": "store_true",
                "help": 'serve tool_choice "auto" (the default with tools): parse calls out of the output (needs '
                "--tool-call-parser)",
            },
        ),
        Flag(
            ("--tool-call-parser",),
            {
                "choices": get_args(ToolParserName),
                "help": "how tool calls are read from the output under tool_choice auto (vLLM's names)",
            },
        ),
        Flag(
            ("--max-stored-responses",),
            {
                "type": int,
                "help": "stored /v1/responses kept in memory for previous_response_id and GET, per API key "
                "(its least recently used finished one dropped first; never one in progress: a new one is then "
                "a 429; 0: store nothing)",
            },
        ),
        Flag(
            ("--max-stored-response-bytes",),
            {
                "type": int,
                "help": "bytes (as JSON) of the stored /v1/responses one API key may keep (default 64 MiB)",
            },
        ),
        Flag(
            ("--disable-any-whitespace",),
            {
                "action": argparse.BooleanOptionalAction,
                "help": "JSON a grammar forces (response_format json_schema, required and named tool calls) has "
                "no whitespace runs outside strings (the default); --no-disable-any-whitespace allows them",
            },
        ),
        Flag(
            ("--max-prompts-per-request",),
            {"type": int, "help": "400 for a completion with more prompts in its list (OpenAI's cap)"},
        ),
        Flag(
            ("--max-sequences-per-request",),
            {"type": int, "help": "400 for a request of more sequences (prompts x n)"},
        ),
        # server
        Flag(("--host",), {"help": "address to listen on"}),
        Flag(("--port",), {"type": int, "help": "port to listen on"}),
        Flag(
            ("--shutdown-timeout",),
            {
                "type": float,
                "help": "seconds in-flight requests may run after SIGTERM before they are aborted",
            },
        ),
        Flag(("--log-level",), {"choices": get_args(LogLevelName)}),
        Flag(
            ("--max-request-head-bytes",),
            {
                "dest": "max_head_bytes",
                "metavar": "MAX_REQUEST_HEAD_BYTES",
                "type": int,
                "help": "431 for a larger request head (414 if the request line alone is larger)",
            },
        ),
        Flag(
            ("--request-head-timeout",),
            {
                "dest": "head_timeout",
                "metavar": "REQUEST_HEAD_TIMEOUT",
                "type": float,
                "help": "408 if a request head is not complete this many seconds after the connection opens (kept alive: after its first byte)",
            },
        ),
        Flag(
            ("--request-body-timeout",),
            {
                "dest": "body_timeout",
                "metavar": "REQUEST_BODY_TIMEOUT",
                "type": float,
                "help": "408 if no byte of a request body arrives for this many seconds",
            },
        ),
        Flag(
            ("--max-grammar-chars",),
            {
                "dest": "max_grammar_chars",
                "metavar": "MAX_GRAMMAR_CHARS",
                "type": int,
                "help": "400 for a longer regex, grammar, JSON schema or choice list (in characters)",
            },
        ),
        Flag(
            ("--grammar-compile-timeout",),
            {
                "dest": "grammar_compile_timeout",
                "metavar": "GRAMMAR_COMPILE_TIMEOUT",
                "type": float,
                "help": "400 for a structured-outputs constraint that takes longer to compile (seconds)",
            },
        ),
        Flag(
            ("--grammar-cache-bytes",),
            {
                "dest": "grammar_cache_bytes",
                "metavar": "GRAMMAR_CACHE_BYTES",
                "type": int,
                "help": "bound of the compiled-grammar cache (xgrammar's cache_limit_bytes)",
            },
        ),
        Flag(
            ("--grammar-fill-timeout",),
            {
                "dest": "grammar_fill_timeout",
                "metavar": "GRAMMAR_FILL_TIMEOUT",
                "type": float,
                "help": "seconds a step waits for a row's grammar mask before aborting that request alone",
            },
        ),
        Flag(
            ("--request-body-deadline",),
            {
                "dest": "body_deadline",
                "metavar": "REQUEST_BODY_DEADLINE",
                "type": float,
                "help": "408 if a whole request body has not arrived this many seconds after its head",
            },
        ),
        # LoRA (vLLM's flags)
        Flag(("--enable-lora",), {"action": "store_true", "help": "serve LoRA adapters (PEFT folders)"}),
        Flag(
            ("--lora-modules",),
            {
                "nargs": "+",
                "metavar": "NAME=PATH",
                "help": 'adapters served from the start: name=path or JSON {"name", "path", "base_model_name"}',
            },
        ),
        Flag(("--max-loras",), {"type": int, "help": "distinct adapters in one step (default 1 with LoRA)"}),
        Flag(("--max-lora-rank",), {"type": int, "help": "highest adapter rank served"}),
        Flag(("--max-cpu-loras",), {"type": int, "help": "adapters kept loaded (default: --max-loras)"}),
        Flag(
            ("--allow-runtime-lora-updating",),
            {
                "action": "store_true",
                "help": "enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
            },
        ),
        Flag(
            ("--limit-concurrency",),
            {
                "dest": "limit_concurrency",
                "metavar": "LIMIT_CONCURRENCY",
                "type": int,
                "help": "503 for connections beyond this many open ones (uvicorn's flag; default: no cap)",
            },
        ),
        Flag(
            ("--speculative-config",),
            {
                "type": _speculative_config,
                "metavar": "JSON",
                "help": 'speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
                '"prompt_lookup_max": 5, "prompt_lookup_min": 2}, "suffix", "auto" (n-gram and suffix drafts, '
                "up to 8 unless num_speculative_tokens says, wherever the measured step costs and acceptance say "
                "they pay), or "
                '{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}; None: off',
            },
        ),
        # images (issue 38)
        Flag(
            ("--limit-mm-per-prompt",),
            {
                "type": _limit_mm_per_prompt,
                "metavar": "JSON",
                "help": f'vLLM\'s JSON: images one prompt may carry, {{"image": 4}} (default: '
                f"{DEFAULT_MAX_IMAGES_PER_PROMPT}; 0 refuses images)",
            },
        ),
        Flag(
            ("--allowed-media-domains",),
            {
                "nargs": "+",
                "metavar": "HOST",
                "help": "hosts http(s) image URLs may name, exactly (default: none; every other URL is a 400 "
                "and no connection is made)",
            },
        ),
        Flag(
            ("--allowed-local-media-path",),
            {
                "type": _existing_dir,
                "metavar": "DIR",
                "help": "file:// image URLs are read only under this folder, symlinks resolved (default: "
                "file:// is refused)",
            },
        ),
        Flag(("--max-image-bytes",), {"type": int, "help": "400 for a larger encoded image"}),
        Flag(
            ("--media-fetch-timeout",),
            {
                "type": float,
                "help": "seconds a whole http(s) image fetch may take (vLLM's VLLM_IMAGE_FETCH_TIMEOUT)",
            },
        ),
        Flag(
            ("--max-image-pixels",),
            {
                "type": int,
                "help": f"400 for an image of more pixels (width x height, read from its header before it is "
                f"decoded); at most {PIL_MAX_IMAGE_PIXELS}, PIL's own guard",
            },
        ),
    ]


def _limit_mm_per_prompt(text: str) -> ModalityLimits:
    """--limit-mm-per-prompt's value; bad JSON, an unknown modality or a negative count exits 2 naming it."""
    try:
        return parse_limit_mm_per_prompt(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _existing_dir(text: str) -> str:
    """A folder that exists; argparse's error (exit 2) otherwise."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not an existing folder")
    return text


def _speculative_config(text: str) -> SpeculativeConfig:
    """--speculative-config's value; a bad one exits 2 with argparse's message naming the flag and the key."""
    try:
        return parse_speculative_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _attention_ffn_config(text: str) -> AttentionFFNConfig | None:
    """--attention-ffn-disaggregation's value; a bad one exits 2 with argparse's message naming the flag."""
    try:
        return parse_attention_ffn_config(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _kv_events_config(text: str) -> KVEventsConfig:
    """--kv-events-config's value; a bad one exits 2 with argparse's message naming the flag and the key."""
    try:
        return parse_kv_events_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# The --help heading and line of each section of the tree, by its path.
_SECTIONS = {
    ("engine", "model_config"): ("model", "what model runs and how, and the longest prompt"),
    ("engine", "cache_config"): ("cache", "the KV cache: block size, its size on the device and the host"),
    ("engine", "scheduler_config"): (
        "scheduler",
        "pagoda.scheduler.SchedulerConfig: batch limits, chunked prefill, prefix caching, preemption, policy",
    ),
    ("engine", "parallel_config"): (
        "parallel",
        "tensor parallelism, or attention apart from the FFN: the ranks one model is split over",
    ),
    ("core",): ("engine cores", "where the engine steps: in the server's process, or engine-core processes"),
    ("serving",): ("serving", "admission limits and names of the engine's asynchronous front (AsyncLLM)"),
    ("app",): ("API", "the OpenAI API app: key, body size, chat template, reasoning and tool-call parsers"),
    ("app", "limits"): ("API request limits", "the fan-out one request may ask for"),
    ("server",): ("server", "address, drain time after SIGTERM, log level"),
    ("server", "limits"): ("HTTP limits", "what one HTTP request may take before the app sees it"),
    ("engine", "lora_config"): ("LoRA", "multi-LoRA serving: adapters, their rank and how many stay loaded"),
    ("engine",): ("speculative decoding", "drafted tokens verified in one forward pass (pagoda.server.spec)"),
    ("engine", "multimodal_config"): (
        "images",
        "images per prompt, where image URLs may point, and how large an image may be",
    ),
    ("engine", "structured_outputs_config"): (
        "structured outputs",
        "the engine's compiled-grammar cache and per-row mask deadline",
    ),
}


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" suffix, left off where the help already says its default or X is None (a
    value derived from the model or the machine, which the help explains)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or "default" in text:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The `pagoda` argument parser: `serve` (one argument group per config section, defaults from the config),
    `chat`, `complete` and `bench serve | throughput | latency`."""
    parser = argparse.ArgumentParser(prog="pagoda", description="Pagoda LLM inference engine.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="start the OpenAI-compatible server",
        formatter_class=_DefaultsHelpFormatter,
    )
    defaults = ServeConfig()
    paths = flat_names(defaults)
    groups: dict[tuple[str, ...], argparse._ArgumentGroup] = {}
    for section, (title, description) in _SECTIONS.items():
        groups[section] = serve.add_argument_group(title, description)
    for flag in argument_table():
        path = paths[flag.alias_of or flag.dest]
        if flag.options == ("model",):  # the positional lists first, outside the groups
            serve.add_argument("model", default=defaults.engine.model_config.model, **flag.kwargs)
            continue
        default = None if flag.alias_of else reduce(getattr, path, defaults)
        groups[path[:-1]].add_argument(*flag.options, default=default, **flag.kwargs)
    # The clients and benchmarks (imported here: their flag tables import this module).
    from pagoda.server.bench.args import add_bench_commands
    from pagoda.server.client.args import add_client_commands

    add_client_commands(commands)
    add_bench_commands(commands)
    return parser


def resolve_tgi_aliases(args: argparse.Namespace) -> dict[str, Any]:
    """The vLLM destinations TGI's aliases set; ValueError naming both flags when they disagree."""
    given: set[str] = getattr(args, "given", set())
    resolved: dict[str, Any] = {}
    options = {flag.dest: flag.options[0] for flag in argument_table()}
    for flag in argument_table():
        if flag.alias_of is None:
            continue
        value, other = getattr(args, flag.dest), getattr(args, flag.alias_of)
        if value is not None and flag.alias_of in given and other != value:
            raise ValueError(
                f"{flag.options[0]} {value} and {options[flag.alias_of]} {other} set the same limit differently"
            )
        resolved[flag.alias_of] = value if value is not None else other
    return resolved


def parse_replica_cpus(text: str) -> tuple[tuple[int, ...], ...]:
    """`--replica-cpus`: "0;1" or "0-3;4-7" or "0,2;1,3" as one tuple of CPUs per engine core."""
    cores: list[tuple[int, ...]] = []
    for entry in text.split(";"):
        cpus: list[int] = []
        for part in filter(None, (p.strip() for p in entry.split(","))):
            first, dash, last = part.partition("-")
            try:
                lo, hi = int(first), int(last if dash else first)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{part!r} is not a CPU number or range (in {text!r})"
                ) from None
            if lo < 0 or hi < lo:
                raise argparse.ArgumentTypeError(f"{part!r} is not a CPU number or range (in {text!r})")
            cpus += range(lo, hi + 1)
        if len(set(cpus)) != len(cpus):
            raise argparse.ArgumentTypeError(f"{entry!r} names a CPU twice (in {text!r})")
        cores.append(tuple(cpus))
    return tuple(cores)


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The one config of parsed `serve` arguments; ValueError naming the flag (and the field) of a bad value."""
    table = argument_table()
    aliases = {flag.dest for flag in table if flag.alias_of is not None}
    flat = {name: value for name, value in vars(args).items() if name in {f.dest for f in table} - aliases}
    flat.update(resolve_tgi_aliases(args))
    try:
        return ServeConfig.from_flat(**flat)
    except ValueError as exc:
        raise ValueError(flag_message(str(exc), table)) from exc


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine part of `serve_config(args)`."""
    return serve_config(args).engine


def flag_message(message: str, table: Sequence[Flag]) -> str:
    """A config error as the CLI says it: field names as their flags, the fields named after it."""
    options = {flag.dest: flag.options[0] for flag in table if flag.options[0].startswith("--")}
    named: list[str] = []

    def to_flag(match: re.Match[str]) -> str:
        named.append(match.group(0))
        return options[match.group(0)]

    pattern = r"\b(" + "|".join(sorted(map(re.escape, options), key=len, reverse=True)) + r")\b"
    text = re.sub(pattern, to_flag, message)
    return f"{text} ({', '.join(dict.fromkeys(named))})" if named else text
