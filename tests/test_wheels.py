"""Every package builds a wheel; blockalloc's and scheduler's install alone into a fresh venv without torch and
pass their own tests there.

In the workspace venv every package can import every other package's dependencies by accident, so the
"stdlib only" promise of blockalloc and scheduler is tested here against the built artifacts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("blockalloc", "pagedkernel", "scheduler", "server")
TORCH_FREE = ("blockalloc", "scheduler")
# Installed beside the two wheels: the test runner, and tqdm for the tools/bench_*.py smoke tests.
TEST_REQUIREMENTS = ("pytest", "hypothesis", "tqdm")
# Everything else in tests/blockalloc and tests/scheduler runs against the wheels.
LEFT_OUT = (
    # mypy under the workspace config, whose mypy_path points at the source tree instead of the wheels.
    f"--ignore={ROOT / 'tests/scheduler/test_scheduler_protocols.py'}",
    # tools/simulate.py draws its plots with matplotlib (and numpy), dependencies of the tool, not the package.
    "--deselect=tests/scheduler/test_scheduler_sim.py::test_simulate_tool_runs_both_modes",
)
# Runs inside the fresh venv: the packages under test must come from it, torch must be absent, then pytest.
RUNNER = """
import importlib.util, sys
from pathlib import Path
import pagoda.blockalloc, pagoda.scheduler, pytest
for module in (pagoda.blockalloc, pagoda.scheduler):
    assert Path(module.__file__).is_relative_to(sys.prefix), f"{module.__name__} from {module.__file__}"
assert importlib.util.find_spec("torch") is None, "torch is importable"
sys.exit(pytest.main(sys.argv[1:]))
"""


def clean_env() -> dict[str, str]:
    """This process's environment without what would point a child interpreter at the workspace's code."""
    return {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"}}


def run(args: list[str], cwd: Path) -> str:
    """Run a command to completion; its output, or a failed assertion showing it."""
    proc = subprocess.run(args, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{args}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`python -m build --wheel` of every package (in parallel; pip's cache serves the build backend)."""
    out = tmp_path_factory.mktemp("dist")
    build = [sys.executable, "-m", "build", "--wheel", "--outdir"]
    builds = {
        name: subprocess.Popen(
            [*build, str(out / name), str(ROOT / "packages" / name)],
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name in PACKAGES
    }
    built: dict[str, Path] = {}
    for name, proc in builds.items():
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"building {name}:\n{log[-6000:]}"
        (built[name],) = (out / name).glob("*.whl")
    return built


@pytest.mark.slow
@pytest.mark.parametrize("name", PACKAGES)
def test_wheel_holds_the_package_and_nothing_else(wheels: dict[str, Path], name: str) -> None:
    """The wheel carries pyproject's version, py.typed, no pagoda/__init__.py (PEP 420) and no other package."""
    with open(ROOT / "packages" / name / "pyproject.toml", "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    assert wheels[name].name == f"pagoda_{name}-{version}-py3-none-any.whl"
    files = zipfile.ZipFile(wheels[name]).namelist()
    assert f"pagoda/{name}/py.typed" in files and f"pagoda/{name}/__init__.py" in files
    own = (f"pagoda/{name}/", f"pagoda_{name}-{version}.dist-info/")
    outside = [f for f in files if not f.startswith(own)]
    assert not outside, outside


@pytest.mark.slow
def test_torch_free_wheels_alone_pass_their_tests(tmp_path: Path, wheels: dict[str, Path]) -> None:
    """A fresh venv (no system site packages) with only the two wheels and the test tools passes their tests."""
    env = tmp_path / "venv"
    # Without pip: the workspace's pip installs into it (`--python`), sparing ensurepip's few seconds.
    venv.EnvBuilder(system_site_packages=False, with_pip=False).create(env)
    python = env / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q"]
    run([*pip, *(str(wheels[name]) for name in TORCH_FREE), *TEST_REQUIREMENTS], tmp_path)
    # -c: an empty config instead of the workspace's (it sets a timeout needing pytest-timeout); --noconftest:
    # the root conftest.py imports torch. --rootdir keeps node ids (and LEFT_OUT) relative to the repository.
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = --strict-markers\n")
    tests = [str(ROOT / "tests" / name) for name in TORCH_FREE]
    args = ["-c", str(tmp_path / "pytest.ini"), f"--rootdir={ROOT}", "--noconftest", "-p", "no:cacheprovider"]
    report = run([str(python), "-c", RUNNER, *args, "-q", *LEFT_OUT, *tests], tmp_path)
    assert " passed" in report and "skipped" not in report, report[-3000:]
