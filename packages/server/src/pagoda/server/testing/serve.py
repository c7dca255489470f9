"""Start `pagoda serve` in a subprocess and return once its /health answers 200: the one launcher of the live tests,
`tools/soak.py` and `tools/bench_serving.py --serve`.

`LiveServer` runs `python -m pagoda.server.cli serve` (the interpreter of the caller, so the same environment) on
127.0.0.1, polls /health until it answers 200, and raises `ServerStartError`, carrying the tail of the server's
output when it was captured, if the process exits first or the deadline passes. `stop()` (or the end of a `with`
block) sends SIGTERM, the server's draining shutdown, and kills it only if it has not exited within the stop timeout.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

import httpx

HOST = "127.0.0.1"
LOG_TAIL_LINES = 40  # of the server's output, in a start error: enough for a traceback, short enough to read
_LOG_TAIL_BYTES = 64 * 1024  # read from the end of the log at most: a chatty server's log can be large


class ServerStartError(RuntimeError):
    """`pagoda serve` exited, or did not answer /health with 200 in time, before it was ready."""

    def __init__(self, message: str, *, returncode: int | None, log_tail: str) -> None:
        super().__init__(f"{message}\n--- last lines of its output ---\n{log_tail}" if log_tail else message)
        self.returncode = returncode  # None: it was still running at the deadline (and was stopped)
        self.log_tail = log_tail  # "" when the output was not captured (it went to the caller's stdout)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def serve_command(
    model: str | Path | None,
    flags: Sequence[str],
    *,
    port: int,
    served_model_name: str | None = None,
    log_level: str = "warning",
) -> list[str]:
    """The `pagoda serve` command line: `model` (None: the server's default), the port, then `flags`."""
    command = [sys.executable, "-m", "pagoda.server.cli", "serve"]
    command += [] if model is None else [str(model)]
    command += ["--port", str(port)]
    command += [] if served_model_name is None else ["--served-model-name", served_model_name]
    return [*command, "--log-level", log_level, *flags]


class LiveServer:
    """A `pagoda serve` subprocess on 127.0.0.1, healthy (/health answered 200) once the constructor returns."""

    def __init__(
        self,
        model: str | Path | None,
        flags: Sequence[str] = (),
        *,
        served_model_name: str | None = None,
        port: int | None = None,
        ready_timeout: float = 120.0,
        poll_interval: float = 0.2,
        stop_timeout: float = 60.0,
        capture_log: bool = True,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.port = free_port() if port is None else port
        self.base_url = f"http://{HOST}:{self.port}"
        self.command = serve_command(model, flags, port=self.port, served_model_name=served_model_name)
        self.stop_timeout = stop_timeout
        self._log_path: Path | None = None
        self._log: IO[bytes] | None = None
        self._final_tail = ""
        if capture_log:
            # A file, not a pipe: nobody reads a pipe while the tests run, and a full one would block the server.
            fd, name = tempfile.mkstemp(prefix="pagoda-serve-", suffix=".log")
            os.close(fd)
            self._log_path = Path(name)
            self._log = open(self._log_path, "ab")  # noqa: SIM115 (closed by stop)
        output = subprocess.STDOUT if capture_log else None
        self.process: subprocess.Popen[bytes] = subprocess.Popen(
            self.command, cwd=cwd, env=None if env is None else dict(env), stdout=self._log, stderr=output
        )
        try:
            self._wait_healthy(ready_timeout, poll_interval)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout: float, poll_interval: float) -> None:
        """Poll /health until it answers 200; ServerStartError if the process exits first or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise ServerStartError(
                    f"`{shlex.join(self.command)}` exited with status {self.process.returncode} before "
                    "/health answered 200",
                    returncode=self.process.returncode,
                    log_tail=self.log_tail(),
                )
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise ServerStartError(
                    f"`{shlex.join(self.command)}` did not answer /health with 200 within {timeout:g} s",
                    returncode=None,
                    log_tail=tail,
                )
            time.sleep(poll_interval)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last `lines` lines of the server's output so far ("" when it was not captured)."""
        if self._log_path is None or not self._log_path.exists():
            return self._final_tail
        with open(self._log_path, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - _LOG_TAIL_BYTES))
            text = log.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> int:
        """SIGTERM the server and wait for it (kill it after the stop timeout); its exit status. Idempotent."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._log_path is not None:
            self._final_tail = self.log_tail()
            with contextlib.suppress(FileNotFoundError):
                self._log_path.unlink()
            self._log_path = None
        return self.process.returncode

    def __enter__(self) -> LiveServer:
        """The server itself: `with LiveServer(...) as server:` stops it at the end of the block."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Stop the server (its exit status is `process.returncode`)."""
        self.stop()
