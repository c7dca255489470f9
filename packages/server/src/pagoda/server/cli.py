"""Command-line entry point: `pagoda serve [MODEL] [OPTIONS]` starts the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, get_args

from pagoda.scheduler import PreemptionMode
from pagoda.server.config import (
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    DEFAULT_MAX_SEQUENCES_PER_REQUEST,
    DistributedExecutorBackendName,
    DTypeName,
    EngineConfig,
    KernelBackendName,
    KVManagerName,
    ReasoningParserName,
    SchedulingPolicyName,
    ToolParserName,
)
from pagoda.server.metrics import DEFAULT_METRICS_PREFIX
from pagoda.server.routing import RoutingPolicyName

if TYPE_CHECKING:
    from pagoda.server.engine_client import EngineClient

logger = logging.getLogger("pagoda.server")

DEFAULT_SHUTDOWN_TIMEOUT = 30.0
# oneDNN (and ideep above it) keep every compiled CPU matmul primitive, one per layer shape and token count, up to
# 1024 each by default: ~130 MB of a server's early growth. 256 keeps the shapes a steady load repeats.
ONEDNN_CACHE_CAPACITY = 256


def bound_onednn_caches() -> None:
    """Cap oneDNN's primitive cache and ideep's LRU cache, unless the environment already sets them.

    Both read their variable once, at the first primitive: call this before the first CPU matmul.
    """
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))


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


# TGI's flag -> (its destination, the vLLM flag and destination that set the same thing, if any).
_TGI_ALIASES = {
    "--max-total-tokens": ("max_total_tokens", "--max-model-len", "max_model_len"),
    "--max-batch-size": ("max_batch_size", "--max-num-seqs", "max_num_seqs"),
    "--max-input-length": ("max_input_length", "--max-input-tokens", "max_input_tokens"),
}


def add_tgi_arguments(serve: argparse.ArgumentParser) -> None:
    """TGI's flags with TGI's meaning, and the chunked-prefill knobs (vLLM's names)."""
    tgi = serve.add_argument_group("TGI names (text-generation-inference)")
    tgi.add_argument(
        "--max-batch-prefill-tokens",
        type=int,
        default=None,
        help="prefill tokens one step may compute (prompt chunks; decodes are not counted)",
    )
    tgi.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="prompt + output tokens of one request (--max-model-len)",
    )
    tgi.add_argument(
        "--max-input-tokens",
        type=int,
        default=None,
        action=_Given,
        help="longest prompt in tokens; a longer one is a 400 (default: --max-model-len - 1)",
    )
    tgi.add_argument(
        "--max-input-length", type=int, default=None, help="TGI's older name of --max-input-tokens"
    )
    tgi.add_argument(
        "--max-batch-size", type=int, default=None, help="most sequences in one step (--max-num-seqs)"
    )
    tgi.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=None,
        help="429 when a request's prompts and those in flight would exceed this; 400 for one that exceeds it alone",
    )
    chunking = serve.add_argument_group("chunked prefill")
    chunking.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split long prompts over steps, beside the running decodes",
    )
    chunking.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        help="cap on one request's prefill chunk in a step (default: only the step's budget)",
    )
    chunking.add_argument(
        "--max-num-partial-prefills",
        type=int,
        default=None,
        help="requests that may be mid-prefill at once (default: no cap)",
    )


def resolve_tgi_aliases(args: argparse.Namespace) -> dict[str, Any]:
    """The vLLM destinations TGI's aliases set; ValueError naming both flags when they disagree."""
    given: set[str] = getattr(args, "given", set())
    resolved: dict[str, Any] = {}
    for tgi_flag, (tgi_dest, vllm_flag, vllm_dest) in _TGI_ALIASES.items():
        value, other = getattr(args, tgi_dest), getattr(args, vllm_dest)
        if value is not None and vllm_dest in given and other != value:
            raise ValueError(f"{tgi_flag} {value} and {vllm_flag} {other} set the same limit differently")
        resolved[vllm_dest] = value if value is not None else other
    return resolved


def build_parser() -> argparse.ArgumentParser:
    """The `pagoda` argument parser (vLLM's flag names where the meaning is the same)."""
    parser = argparse.ArgumentParser(prog="pagoda", description="Pagoda LLM inference engine.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="start the OpenAI-compatible server",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_argument(
        "model", nargs="?", default=None, help="HF model folder or .gguf file (default: Gemma 3 270M)"
    )
    server = serve.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8000, help="port to listen on")
    server.add_argument("--served-model-name", default=None, help="model name in the API (default: MODEL)")
    server.add_argument(
        "--api-key", default=None, help="require `Authorization: Bearer <key>` (all but /health)"
    )
    server.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="429 when a request's sequences (prompts x n) and those waiting for their first token would "
        "exceed this; 400 for a request that exceeds it alone",
    )
    server.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=DEFAULT_MAX_PROMPTS_PER_REQUEST,
        help="400 for a completion with more prompts in its list (OpenAI's cap)",
    )
    server.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=DEFAULT_MAX_SEQUENCES_PER_REQUEST,
        help="400 for a request of more sequences (prompts x n)",
    )
    server.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT,
        help="seconds in-flight requests may run after SIGTERM before they are aborted",
    )
    server.add_argument(
        "--max-request-body-bytes", type=int, default=4 * 1024 * 1024, help="413 for larger request bodies"
    )
    # HTTP limits (HTTPLimits): what a request may take before the app sees it.
    server.add_argument(
        "--max-request-head-bytes",
        type=int,
        default=16 * 1024,
        help="431 for a larger request head (414 if the request line alone is larger)",
    )
    server.add_argument(
        "--request-head-timeout",
        type=float,
        default=10.0,
        help="408 if a request head is not complete this many seconds after the connection opens",
    )
    server.add_argument(
        "--request-body-timeout",
        type=float,
        default=30.0,
        help="408 if no byte of a request body arrives for this many seconds",
    )
    server.add_argument(
        "--chat-template",
        default=None,
        help="chat template for the chat endpoint, as a file path or the Jinja text (default: the tokenizer's)",
    )
    server.add_argument(
        "--reasoning-parser",
        choices=get_args(ReasoningParserName),
        default=None,
        help="split <think> reasoning into the chat responses' reasoning_content (vLLM's names)",
    )
    server.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto" (the default with tools): parse calls out of the output (needs --tool-call-parser)',
    )
    server.add_argument(
        "--tool-call-parser",
        choices=get_args(ToolParserName),
        default=None,
        help="how tool calls are read from the output under tool_choice auto (vLLM's names)",
    )
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    engine = serve.add_argument_group("engine")
    engine.add_argument(
        "--tokenizer", default=None, help="folder of the tokenizer's files (default: the model's own)"
    )
    engine.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        action=_Given,
        help="longest prompt + output (default: model's)",
    )
    engine.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    engine.add_argument(
        "--max-num-seqs", type=int, default=256, action=_Given, help="most sequences in one step"
    )
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    engine.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="CUDA: fraction of GPU memory the engine may use",
    )
    engine.add_argument("--kv-cache-gib", type=float, default=4.0, help="CPU: KV-cache size in GiB")
    engine.add_argument(
        "--swap-space", type=float, default=4.0, help="host swap space in GiB (preemption by swap)"
    )
    engine.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of shared prompt prefixes",
    )
    engine.add_argument(
        "--preemption-mode",
        choices=get_args(PreemptionMode),
        default="recompute",
        help="auto: per victim, whichever of swap and recompute costs less on this machine (measured at start)",
    )
    engine.add_argument("--enforce-eager", action="store_true", help="CUDA: skip torch.compile")
    engine.add_argument("--kernel-backend", choices=get_args(KernelBackendName), default="auto")
    engine.add_argument("--dtype", choices=get_args(DTypeName), default="auto")
    engine.add_argument("--seed", type=int, default=0, help="engine seed for requests without their own")
    fields = serve.add_argument_group("metrics")
    fields.add_argument(
        "--metrics-prefix",
        default=DEFAULT_METRICS_PREFIX,
        help="namespace of the /metrics names (`vllm` for stock vLLM Grafana dashboards)",
    )
    add_tgi_arguments(serve)
    add_scheduling_args(serve)
    add_parallel_args(serve)
    return parser


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    """Where the engine runs: tensor-parallel ranks of one model, engine-core processes and replicas (vLLM's flags)."""
    group = parser.add_argument_group("parallelism and engine cores")
    group.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split every layer over N ranks (gloo on CPU, NCCL on CUDA); N must divide the attention heads",
    )
    group.add_argument(
        "--engine-core",
        choices=["inproc", "process"],
        default="inproc",
        help="inproc: the engine steps on a thread of the server's process; process: in an engine-core process "
        "of its own, over ZeroMQ (implied by --data-parallel-size > 1)",
    )
    group.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine-core replicas, each with its own model, KV cache and cores, behind one router",
    )
    group.add_argument(
        "--routing-policy",
        choices=get_args(RoutingPolicyName),
        default="cache_aware",
        help="which replica serves a request: the one holding its prefix (cache_aware), the least loaded, or "
        "each in turn",
    )
    group.add_argument(
        "--distributed-executor-backend",
        choices=get_args(DistributedExecutorBackendName),
        default="mp",
        help="where the processes beyond the first run: mp: local processes; ray: Ray actors on the cluster of "
        "RAY_ADDRESS (or `ray start --head`), tensor-parallel ranks in a placement group",
    )
    group.add_argument(
        "--engine-ready-timeout",
        type=float,
        default=600.0,
        help="seconds an engine core may take to load its model before the server gives up",
    )


def add_scheduling_args(parser: argparse.ArgumentParser) -> None:
    """The scheduler's two axes: batching policy and KV reservation (static + contiguous is the seed's baseline)."""
    group = parser.add_argument_group("scheduling")
    group.add_argument(
        "--scheduling-policy",
        choices=get_args(SchedulingPolicyName),
        default="fcfs",
        help="fcfs: continuous batching in arrival order; priority: lower `priority` first; static: a batch of "
        "up to --max-num-seqs runs to completion and nobody joins it",
    )
    group.add_argument(
        "--static-batch-timeout",
        type=float,
        default=0.0,
        help="static: seconds the oldest request waits for a full batch before a smaller one starts",
    )
    group.add_argument(
        "--kv-manager",
        choices=get_args(KVManagerName),
        default="paged",
        help="paged: blocks on demand; contiguous: each sequence reserves --max-model-len tokens at admission "
        "(no prefix caching, no swapping)",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of parsed `serve` arguments (raises ValueError naming a bad field)."""
    tgi = resolve_tgi_aliases(args)
    return EngineConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        max_model_len=tgi["max_model_len"],
        max_num_seqs=tgi["max_num_seqs"],
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_gib=args.kv_cache_gib,
        swap_space_gib=args.swap_space,
        enable_prefix_caching=args.enable_prefix_caching,
        preemption_mode=args.preemption_mode,
        enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_num_partial_prefills=args.max_num_partial_prefills,
        max_batch_prefill_tokens=args.max_batch_prefill_tokens,
        max_input_tokens=tgi["max_input_tokens"],
        enforce_eager=args.enforce_eager,
        kernel_backend=args.kernel_backend,
        dtype=args.dtype,
        seed=args.seed,
        scheduling_policy=args.scheduling_policy,
        static_batch_timeout_s=args.static_batch_timeout,
        kv_manager=args.kv_manager,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
    )


def check_server_args(args: argparse.Namespace) -> None:
    """Reject server options out of range (ValueError naming the flag)."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise ValueError("--max-waiting-requests must be >= 1")
    if args.max_prompts_per_request < 1:
        raise ValueError("--max-prompts-per-request must be >= 1")
    if args.max_sequences_per_request < 1:
        raise ValueError("--max-sequences-per-request must be >= 1")
    if args.shutdown_timeout < 0:
        raise ValueError("--shutdown-timeout must be >= 0")
    if args.max_request_body_bytes < 1:
        raise ValueError("--max-request-body-bytes must be >= 1")
    if args.max_request_head_bytes < 1024:
        raise ValueError("--max-request-head-bytes must be >= 1024")
    if args.request_head_timeout <= 0:
        raise ValueError("--request-head-timeout must be > 0")
    if args.request_body_timeout <= 0:
        raise ValueError("--request-body-timeout must be > 0")
    if args.max_concurrent_requests is not None and args.max_concurrent_requests < 1:
        raise ValueError("--max-concurrent-requests must be >= 1")
    if args.data_parallel_size < 1:
        raise ValueError("--data-parallel-size must be >= 1")
    if args.engine_ready_timeout <= 0:
        raise ValueError("--engine-ready-timeout must be > 0")
    if not 0 <= args.port <= 65535:
        raise ValueError("--port must be in [0, 65535]")
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", args.metrics_prefix) is None:
        raise ValueError(
            "--metrics-prefix must be a Prometheus name: letters, digits and _, not a digit first"
        )


def serve(args: argparse.Namespace) -> int:
    """Load the engine, log its KV capacity, serve until SIGTERM; return the exit status."""
    bound_onednn_caches()
    # Imported here so that `pagoda --help` stays fast (the engine imports torch and transformers).
    from pagoda.server.chat import load_chat_template
    from pagoda.server.core import CoreClient, CoreStartupError
    from pagoda.server.engine import LLMEngine
    from pagoda.server.engine.executor import ExecutorError

    try:
        check_server_args(args)
        config = engine_config(args)
        chat_template = None if args.chat_template is None else load_chat_template(args.chat_template)
    except ValueError as exc:
        print(f"pagoda serve: {exc}", file=sys.stderr)
        return 2
    try:
        client = _start_engine(args, config)
    except (ValueError, CoreStartupError, ExecutorError) as exc:  # EngineConfigError says what to change
        print(f"pagoda serve: cannot start: {exc}", file=sys.stderr)
        return 1
    # build_parts already refused a KV cache smaller than one max_model_len request (EngineConfigError above).
    logger.info(
        "KV cache: %d blocks of %d tokens = %d tokens (per replica); max_model_len %d",
        client.num_kv_blocks,
        client.block_size,
        client.num_kv_blocks * client.block_size,
        client.max_model_len,
    )
    try:
        _serve_engine(args, client, chat_template)
    finally:
        if isinstance(client, CoreClient):
            client.close()
        elif isinstance(client, LLMEngine):
            client.shutdown()  # tensor-parallel workers exit with the server
    return 0


def _start_engine(args: argparse.Namespace, config: EngineConfig) -> EngineClient:
    """The in-process engine, or engine-core processes (Ray actors) behind a router."""
    from pagoda.server.core.start import start_core_client
    from pagoda.server.engine import LLMEngine

    if args.engine_core == "inproc" and args.data_parallel_size == 1:
        return LLMEngine.from_config(config)  # mypy proves the engine satisfies the API's Protocol
    return start_core_client(
        config,
        data_parallel_size=args.data_parallel_size,
        routing_policy=args.routing_policy,
        backend=args.distributed_executor_backend,
        log_level=logging.getLevelName(args.log_level.upper()),
        ready_timeout=args.engine_ready_timeout,
    )


def _serve_engine(args: argparse.Namespace, client: EngineClient, chat_template: str | None) -> None:
    """Serve `client` until SIGTERM drained it."""
    from pagoda.server.api import AppSettings, build_app
    from pagoda.server.api.http_protocol import HTTPLimits
    from pagoda.server.api.server import run_server
    from pagoda.server.async_llm import AsyncLLM
    from pagoda.server.config import RequestLimits

    llm = AsyncLLM(
        client,
        served_model_name=args.served_model_name or client.model_name,
        max_waiting_requests=args.max_waiting_requests,
        metrics_prefix=args.metrics_prefix,
        max_concurrent_requests=args.max_concurrent_requests,
    )
    limits = RequestLimits(
        max_prompts_per_request=args.max_prompts_per_request,
        max_sequences_per_request=args.max_sequences_per_request,
    )
    settings = AppSettings(
        api_key=args.api_key,
        max_body_bytes=args.max_request_body_bytes,
        limits=limits,
        chat_template=chat_template,
        reasoning_parser=args.reasoning_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
    )
    app = build_app(llm, settings)
    # Everything loaded so far (model, tokenizer, libraries) lives until exit: move it out of the collector's
    # sight, so that full collections while serving, and the one at exit, do not walk it again and again.
    gc.collect()
    gc.freeze()
    run_server(
        app,
        llm,
        host=args.host,
        port=args.port,
        shutdown_timeout=args.shutdown_timeout,
        limits=HTTPLimits(
            max_head_bytes=args.max_request_head_bytes,
            head_timeout=args.request_head_timeout,
            body_timeout=args.request_body_timeout,
        ),
        log_level=args.log_level,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `pagoda` command line; returns the exit status."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return serve(args)
    return 2  # argparse rejects unknown commands before this


if __name__ == "__main__":
    sys.exit(main())
