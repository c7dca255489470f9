"""A minimal Chrome DevTools Protocol client: Debian's headless chromium, one page, commands over a websocket."""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import pytest
from websockets.sync.client import ClientConnection, connect


def chromium_path() -> str:
    """The chromium binary; a test FAILURE (never a skip) when it is missing: CI installs it (tools/dev.py)."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("chromium is not installed: `apt-get install chromium` (tools/dev.py test installs it)")
    return found


class Browser:
    """A headless chromium on loopback with a fresh profile, and a CDP session to its first page."""

    def __init__(self, width: int = 1400, height: int = 1000) -> None:
        self._profile = Path(tempfile.mkdtemp(prefix="pagoda-chromium-"))
        self.process = subprocess.Popen(
            [
                chromium_path(),
                "--headless=new",
                "--no-sandbox",  # root in CI containers
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                f"--user-data-dir={self._profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._ids = itertools.count(1)
        try:
            port = self._port()
            pages = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
            url = next(p["webSocketDebuggerUrl"] for p in pages if p["type"] == "page")
            self.ws: ClientConnection = connect(url, max_size=64 * 1024 * 1024, open_timeout=30).__enter__()
            self.send("Page.enable")
            self.send("Runtime.enable")
        except BaseException:
            self.close()
            raise

    def _port(self, timeout: float = 60.0) -> int:
        """The debugging port chromium chose (it writes it into the profile)."""
        marker = self._profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if marker.exists() and (text := marker.read_text().split()):
                return int(text[0])
            if self.process.poll() is not None:
                raise RuntimeError(f"chromium exited with status {self.process.returncode}")
            time.sleep(0.1)
        raise RuntimeError("chromium did not open its debugging port")

    def send(
        self, method: str, params: dict[str, Any] | None = None, timeout: float = 60.0
    ) -> dict[str, Any]:
        """Send one command and return its result (events that arrive meanwhile are dropped)."""
        msg_id = next(self._ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params or {}}))
        deadline = time.monotonic() + timeout
        while True:
            message = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if message.get("id") == msg_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                result: dict[str, Any] = message["result"]
                return result

    def evaluate(self, expression: str) -> Any:
        """The JSON value of a JS expression in the page."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def navigate(self, url: str) -> None:
        """Load `url` and wait for the document to finish loading."""
        self.send("Page.navigate", {"url": url})
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'")

    def wait_for(self, expression: str, timeout: float = 120.0) -> Any:
        """Poll a JS expression until it is truthy; return it (AssertionError on timeout)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"never true: {expression}")

    def heap_used(self) -> int:
        """JS heap in use after a full garbage collection, in bytes."""
        self.send("HeapProfiler.collectGarbage")
        used: int = self.send("Runtime.getHeapUsage")["usedSize"]
        return used

    def screenshot(self, path: Path) -> None:
        """A PNG of the page as it is now."""
        data = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        """Quit chromium and delete its profile."""
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(20)
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        """Itself."""
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Close."""
        self.close()
