"""A real terminal for the interactive CLI tests: a command in a detached tmux pane, keys sent, the screen read.

Without tmux the tests using it FAIL, they never skip: CI installs it (tools/dev.py test, as it does chromium).
"""

from __future__ import annotations

import itertools
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType

import pytest

_SESSIONS = itertools.count()


def tmux_path() -> str:
    """The tmux binary; a test FAILURE (never a skip) when it is missing."""
    found = shutil.which("tmux")
    if found is None:
        pytest.fail("tmux is not installed: `apt-get install tmux` (tools/dev.py test installs it)")
    return found


class Terminal:
    """`command` running in a 200-column tmux pane of its own tmux server; `screen()` is what the pane shows."""

    def __init__(
        self, command: Sequence[str], env: Mapping[str, str], width: int = 200, height: int = 50
    ) -> None:
        self.tmux = tmux_path()
        self.socket = f"pagoda-test-{os.getpid()}-{next(_SESSIONS)}"  # a private tmux server
        # The command's exit status stays on the screen: the tests read it after Ctrl-D.
        line = f'{shlex.join(command)}; echo "[exit status $?]"; sleep 600'
        env_args = [f"{key}={value}" for key, value in env.items()]
        self._tmux(
            "new-session",
            "-d",
            "-s",
            "main",
            "-x",
            str(width),
            "-y",
            str(height),
            "env",
            *env_args,
            "sh",
            "-c",
            line,
        )

    def _tmux(self, *args: str) -> str:
        """Run a tmux command on this terminal's server; its stdout."""
        done = subprocess.run(
            [self.tmux, "-L", self.socket, *args], capture_output=True, text=True, timeout=30, check=True
        )
        return done.stdout

    def send_line(self, text: str) -> None:
        """Type `text` (literally) and Enter."""
        self._tmux("send-keys", "-t", "main", "-l", text)
        self._tmux("send-keys", "-t", "main", "Enter")

    def send_key(self, key: str) -> None:
        """Press one key by tmux's name (C-d, C-c)."""
        self._tmux("send-keys", "-t", "main", key)

    def screen(self) -> list[str]:
        """The pane's lines, wrapped lines joined (-J), trailing blank lines dropped."""
        lines = self._tmux("capture-pane", "-p", "-J", "-t", "main").rstrip("\n").split("\n")
        while lines and not lines[-1].strip():
            lines.pop()
        return [line.rstrip() for line in lines]

    def wait_for(self, condition: Callable[[list[str]], bool], what: str, timeout: float = 60.0) -> list[str]:
        """Poll the screen until `condition(lines)` holds; the lines then. Fails showing the screen on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            lines = self.screen()
            if condition(lines):
                return lines
            if time.monotonic() > deadline:
                pytest.fail(f"the terminal never showed {what}; it shows:\n" + "\n".join(lines))
            time.sleep(0.05)

    def close(self) -> None:
        """Kill this terminal's tmux server (and the command in it)."""
        subprocess.run(
            [self.tmux, "-L", self.socket, "kill-server"], capture_output=True, timeout=30, check=False
        )

    def __enter__(self) -> Terminal:
        """The terminal, closed at the end of the block."""
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        """Close the terminal."""
        self.close()
