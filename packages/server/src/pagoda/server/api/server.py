"""Run the app under uvicorn with a graceful drain on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from types import FrameType

import uvicorn
from pagoda.server.api.http_protocol import HTTPConfig
from pagoda.server.async_llm import AsyncLLM
from pagoda.server.config import ServerConfig
from pagoda.server.startup import log_phase
from starlette.applications import Starlette

logger = logging.getLogger(__name__)

# The process's status when the engine failed for good (--on-engine-failure exit, or a failed rebuild).
ENGINE_FAILURE_EXIT_STATUS = 1
# After the drain, how long uvicorn waits for responses still being written before it cuts them.
_FLUSH_SECONDS = 5.0


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM/SIGINT drains the engine, then exits with status 0.

    Draining: new requests get 503, in-flight ones may finish within `shutdown_timeout` seconds, the rest are
    aborted (their clients get finish_reason "abort"). A second signal exits at once, as uvicorn does.
    """

    def __init__(self, config: uvicorn.Config, llm: AsyncLLM, shutdown_timeout: float) -> None:
        super().__init__(config)
        self._llm = llm
        self._shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_requested = False
        self._drain_task: asyncio.Task[None] | None = None
        self._fatal_task: asyncio.Task[None] | None = None
        self.exit_status = 0  # what `run_server` returns: non-zero once the engine failed for good
        self._created = time.perf_counter()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Remember the event loop so the signal handler can schedule the drain on it; watch for a fatal engine."""
        self._loop = asyncio.get_running_loop()
        self._fatal_task = asyncio.ensure_future(self._exit_on_fatal())
        await super().startup(sockets)
        log_phase("HTTP server listening", self._created)

    async def _exit_on_fatal(self) -> None:
        # --on-engine-failure exit: the engine died for good, so the process ends non-zero for its supervisor.
        await self._llm.wait_fatal()
        logger.critical("the engine failed: the server exits with status %d", ENGINE_FAILURE_EXIT_STATUS)
        self.exit_status = ENGINE_FAILURE_EXIT_STATUS
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First signal: drain in the background; later signals (or one before start-up): uvicorn's exit."""
        if self._drain_requested or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self._drain_requested = True
        # Runs in the signal handler, between two bytecodes of the loop thread: only schedule work here.
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        logger.info("shutting down: draining in-flight requests (up to %.1f s)", self._shutdown_timeout)
        try:
            await self._llm.drain(self._shutdown_timeout)
        finally:
            self.should_exit = True


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), to be taken before the engine starts; OSError if it cannot be.

    Bound first, as vLLM does, so that nothing the start creates (an engine core's block server on an ephemeral
    port, say) can take the port, and so that a port in use fails in a second rather than after the model loads.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        # As uvicorn binds: a restarted server need not wait out the last one's TIME_WAIT connections.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def run_server(
    app: Starlette, llm: AsyncLLM, config: ServerConfig | None = None, sock: socket.socket | None = None
) -> int:
    """Serve `app` on `sock` (or, without one, `config`'s address) with `config`'s HTTP limits until a signal
    drains and stops it (0), or the engine failed for good (ENGINE_FAILURE_EXIT_STATUS); the exit status."""
    config = config or ServerConfig()
    http = HTTPConfig(
        app,
        config.limits,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        lifespan="on",
        timeout_graceful_shutdown=int(_FLUSH_SECONDS),
    )
    server = DrainingServer(http, llm, config.shutdown_timeout)
    server.run(sockets=None if sock is None else [sock])
    return server.exit_status
