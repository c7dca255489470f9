"""A local Ray cluster for a test, started by `ray start` in a process of its own.

Why not `ray.init(num_cpus=...)` in the test process: Ray forks its head processes from the caller (a `preexec_fn`,
so never vfork), and a fork must account for each private writable mapping the caller holds. A pytest worker that
has built hundreds of engines holds a glibc heap of many GB that is mostly freed and untouched (RSS ~1-2 GB); once
that one mapping outgrows the machine's RAM the kernel refuses the fork with ENOMEM (seen in CI on a 24 GB machine).
`subprocess` without a `preexec_fn` uses vfork, which copies nothing.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pagoda.server.testing import free_port

START_TIMEOUT_S = 120.0


def ensure_ray_token() -> Path:
    """Ray's default token file (~/.ray/auth_token), created once if missing: written aside and linked into place,
    so two test workers starting clusters at once agree on one token and neither reads a half-written file (Ray's
    own writer truncates and rewrites)."""
    path = Path.home() / ".ray" / "auth_token"
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        return path
    fd, aside = tempfile.mkstemp(dir=path.parent, prefix=".auth_token.")  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)  # atomic; the first writer wins
    finally:
        os.unlink(aside)
    return path


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the head's process group (`ray start --block` stops what it started), SIGKILL what is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(30)


@dataclass(frozen=True)
class RayHead:
    """A running head: its GCS address, and the RAY_TMPDIR under which `ray.init(address="auto")` finds it."""

    address: str
    tmpdir: Path


@contextlib.contextmanager
def ray_head(num_cpus: int = 2) -> Iterator[RayHead]:
    """A Ray head node of `num_cpus` CPUs with token authentication (the installed Ray's default), its own temp
    folder (so that `ray.init(address="auto")` finds it only where RAY_TMPDIR names that folder) and no
    dashboard; stops every process it started on exit."""
    ensure_ray_token()
    root = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's unix socket paths live under it
    folder = root / "ray"  # Ray's temp folder under RAY_TMPDIR=root
    folder.mkdir()
    port = free_port()
    argv = [
        str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", f"--num-cpus={num_cpus}",
        f"--port={port}", "--include-dashboard=false",
        "--disable-usage-stats", f"--temp-dir={folder}",
    ]  # fmt: skip
    log = folder / "head.log"
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    env.pop("RAY_ADDRESS", None)
    with log.open("wb") as out:
        process = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        address_file = folder / "ray_current_cluster"  # written once the head is up
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (address_file.exists() and address_file.read_text().strip()):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"`ray start --head` did not come up:\n{log.read_text()[-4000:]}")
            time.sleep(0.2)
        yield RayHead(address_file.read_text().strip(), root)
    finally:
        _stop(process)
        shutil.rmtree(root, ignore_errors=True)
