"""Command-line entry point: `pagoda serve [MODEL] [OPTIONS]` starts the OpenAI-compatible server; `pagoda chat`,
`pagoda complete` (pagoda.server.client) and `pagoda bench serve | throughput | latency` (pagoda.server.bench) are
vLLM's commands of the same names."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from importlib import import_module
from typing import TYPE_CHECKING

from pagoda.server.cli_args import build_parser, engine_config, serve_config
from pagoda.server.config import ServeConfig

__all__ = ["build_parser", "engine_config", "main", "serve", "serve_config"]

if TYPE_CHECKING:
    from pagoda.server.engine_client import EngineClient

logger = logging.getLogger("pagoda.server")

# oneDNN (and ideep above it) keep every compiled CPU matmul primitive, one per layer shape and token count, up to
# 1024 each by default: ~130 MB of a server's early growth. 256 keeps the shapes a steady load repeats.
ONEDNN_CACHE_CAPACITY = 256


def bound_onednn_caches() -> None:
    """Cap oneDNN's primitive cache and ideep's LRU cache, unless the environment already sets them.

    Both read their variable once, at the first primitive: call this before the first CPU matmul.
    """
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))


def _check_quantization(config: ServeConfig) -> None:
    """ValueError (exit 2) naming the layer when --quantization int8/int4 cannot split a folder's weights."""
    model = config.engine.model_config
    if model.quantizes_at_load() and model.model is not None:
        from pagoda.server.loader.quantize_at_load import check_folder_quantizable

        check_folder_quantizable(model.model, model.quantization, model.quantization_group_size)


def _check_packaged_model(config: ServeConfig) -> None:
    """ValueError (exit 2) with the install command when a packaged model's package is missing, before any load."""
    from pagoda.server.loader.default import PackagedModelMissingError, check_installed
    from pagoda.server.packaged import packaged_model

    model = packaged_model(config.engine.model_config.model)
    if model is None:
        return
    try:
        check_installed(model)
    except PackagedModelMissingError as exc:
        raise ValueError(str(exc)) from None


def _check_draft_model(config: ServeConfig) -> None:
    """ValueError (exit 2) naming the key 'model' for a draft model of another vocabulary than the target's,
    found from configs and tokenizers before any weight loads."""
    spec = config.engine.speculative_config
    if spec is None or spec.model is None:
        return
    from pathlib import Path

    from pagoda.server.spec.draft_check import check_draft_vocabulary

    model = config.engine.model_config
    cache_dir = None if model.cache_dir is None else Path(model.cache_dir)
    try:
        check_draft_vocabulary(model.model, spec.model, tokenizer=model.tokenizer, cache_dir=cache_dir)
    except ValueError as exc:
        raise ValueError(f"--speculative-config: {exc}") from None


def _check_gguf(config: ServeConfig) -> None:
    """ValueError (exit 2) for a malformed .gguf file or a GGUF cache another user could write (issue 43)."""
    from pathlib import Path

    from pagoda.server.loader.gguf import check_gguf_model

    model = config.engine.model_config
    check_gguf_model(model.model, None if model.cache_dir is None else Path(model.cache_dir))


def _check_runner(config: ServeConfig) -> None:
    """ValueError (exit 2) naming --runner when a sequence-classification model is not served by the pooling
    runner, found from its config.json before any weight loads."""
    from pagoda.server.pooling.classifier import check_model_folder

    model = config.engine.model_config
    check_model_folder(model.model, model.runner)


def _check_attention_ffn(config: ServeConfig) -> None:
    """ValueError (exit 2) naming --attention-ffn-disaggregation when the model's config shows that its layers or
    heads do not split over the asked workers, or local workers would need more GPUs than are visible, before any
    weight loads or worker starts."""
    if config.engine.parallel_config.attention_ffn_disaggregation is None:
        return
    from pagoda.server.engine.executor.afd import check_launch
    from pagoda.server.engine.executor.distributed import model_folder

    try:
        folder = model_folder(config.engine)
    except OSError:  # no such model: the load says so, as it does without the flag
        return
    check_launch(config.engine, folder)


def serve(args: argparse.Namespace) -> int:
    """Load the engine, log its KV capacity, serve until SIGTERM; return the exit status."""
    # No cyclic garbage collection until the start is done (`gc.freeze()` in _serve_engine): the imports and the
    # loading make hundreds of thousands of long-lived objects, and the collections they trigger found nothing
    # worth freeing while costing ~0.3 s of a 3 s start (measured: 2.99 s -> 2.69 s for the imports alone).
    gc.disable()
    bound_onednn_caches()
    # Before anything imports transformers: its scan of its own model folders comes from a cache (~1.2 s).
    from pagoda.server.import_cache import install

    install()
    # Imported here so that `pagoda --help` stays fast (the engine imports torch and transformers).
    from pagoda.server.chat import load_chat_template
    from pagoda.server.engine.kv_dtype import check_kv_cache_dtype
    from pagoda.server.kv_tiers.setup import check_kv_tier_flags, with_shared_host_tier
    from pagoda.server.startup import log_phase, process_age

    # The HTTP side's modules now too (_serve_engine uses them): the phase below then counts every import.
    import_module("pagoda.server.api.server")
    # The interpreter's start and every import so far (torch, transformers, the engine's and the API's modules).
    log_phase("python and imports", time.perf_counter() - process_age())
    try:
        config = serve_config(args)
        _check_quantization(config)
        _check_packaged_model(config)
        _check_gguf(config)
        _check_draft_model(config)
        _check_runner(config)
        _check_attention_ffn(config)
        # fp8 where it cannot run is a bad flag (exit 2), not a failed start
        check_kv_cache_dtype(config.engine)
        check_kv_tier_flags(config.engine.cache_config)
        if config.app.chat_template is not None:  # a file path or the template's text, read once here
            app = replace(config.app, chat_template=load_chat_template(config.app.chat_template))
            config = replace(config, app=app)
    except ValueError as exc:
        print(f"pagoda serve: {exc}", file=sys.stderr)
        return 2
    from pagoda.server.api.server import listen_socket

    # The port is bound (not yet listening: /health is refused until the engine is ready) before any engine core
    # starts, so that none of their own sockets can take it, and a port in use fails before the model loads.
    address = f"{config.server.host}:{config.server.port}"
    try:
        sock = listen_socket(config.server.host, config.server.port)
    except OSError as exc:
        print(f"pagoda serve: cannot listen on {address}: {exc}", file=sys.stderr)
        return 1
    # The host KV tier's shared file is the server's: it outlives engine cores (and their restarts), not the server.
    # With --kv-transfer tcp each core keeps a tier of its own (as on separate hosts) and blocks move over TCP.
    tier_file = None
    if config.core.kv_transfer != "tcp":
        engine_config, tier_file = with_shared_host_tier(config.engine)
        config = replace(config, engine=engine_config)
    try:
        return _start_and_serve(config, sock)
    finally:
        sock.close()
        if tier_file is not None:
            tier_file.unlink(missing_ok=True)


def _start_and_serve(config: ServeConfig, sock: socket.socket) -> int:
    """Start the engine (cores) and serve on `sock`; the exit status."""
    from pagoda.server.core import CoreConfigError, CoreStartupError
    from pagoda.server.engine.executor import ExecutorError
    from pagoda.server.engine.setup import MaxModelLenError

    try:
        client = start_engine(config)
    except (MaxModelLenError, CoreConfigError) as exc:  # e.g. --max-model-len beyond what the KV pool holds
        print(f"pagoda serve: cannot start: {exc}", file=sys.stderr)
        return 2
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
        return _serve_engine(config, client, sock)
    finally:
        client.close()  # tensor-parallel workers and engine cores exit with the server


def start_engine(config: ServeConfig) -> EngineClient:
    """The in-process engine, or engine-core processes (Ray actors) behind a router."""
    from pagoda.server.core.start import start_core_client
    from pagoda.server.engine import LLMEngine

    if config.core.in_process:
        return LLMEngine.from_config(config.engine)  # mypy proves the engine satisfies the API's Protocol
    log_level = logging.getLevelName(config.server.log_level.upper())
    return start_core_client(config.engine, config.core, log_level=log_level)


def _serve_engine(config: ServeConfig, client: EngineClient, sock: socket.socket) -> int:
    """Serve `client` on `sock` until SIGTERM drained it (0), or until the engine failed for good (1); the exit status."""
    from pagoda.server.api import build_app
    from pagoda.server.api.server import run_server
    from pagoda.server.async_llm import AsyncLLM
    from pagoda.server.startup import log_phase

    def rebuild() -> EngineClient:
        """A fresh in-process engine from the same config (--on-engine-failure restart)."""
        return start_engine(config)

    start = time.perf_counter()
    # Engine cores restart on their own (CoreClient); only an in-process engine is rebuilt here.
    llm = AsyncLLM(client, config.serving, rebuild=rebuild if config.core.in_process else None)
    from pagoda.server.api.images import image_front

    # The model folder's processor (None: a text-only model) and the image flags' policy.
    images = image_front(client.tokenizer.name_or_path, config.engine.multimodal_config)
    app = build_app(llm, config.app, config.engine.lora_config, images)
    start = log_phase("API app", start)
    # Everything loaded so far (model, tokenizer, libraries) lives until exit: move it out of the collector's
    # sight, so that full collections while serving, and the one at exit, do not walk it again and again. No full
    # collection first: it took 0.1-0.45 s of every start to find ~750 cyclic objects (120 KB, no tensor) that
    # freezing now keeps.
    gc.freeze()
    gc.enable()  # disabled since serve() began
    log_phase("gc freeze", start)
    try:
        return run_server(app, llm, config.server, sock)
    finally:
        if llm.engine is not client:  # a rebuilt engine: `serve` closes the first one
            llm.engine.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `pagoda` command line; returns the exit status."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    level = getattr(args, "log_level", "warning")  # only `serve` has --log-level
    logging.basicConfig(level=level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return serve(args)
    status: int = args.run(args)  # chat, complete, bench: set by their parsers
    return status


if __name__ == "__main__":
    sys.exit(main())
