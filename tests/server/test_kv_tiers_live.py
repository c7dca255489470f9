"""The host KV tier in a live server (issue 39): two data-parallel replicas share it (a prefix one computed is a
hit on the other, reported as cached tokens, streamed usage included), it outlives a replica's restart, the
server removes its shared file at exit, and bad tier flags exit 2 naming the flag."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from api_cases import MODEL
from pagoda.server.testing import make_tiny_model
from test_api_live import NO_EOS, LiveServer, serving, sync_client
from test_engine_core import CORE_FLAGS, READY_S, _core_pids, wait_replicas_alive

PREFIX = [10 + i for i in range(256)]  # 16 full blocks of 16 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("tier-live") / "m", max_position_embeddings=4096)


def cached_tokens(live: LiveServer, prompt: list[int]) -> tuple[int, str]:
    """(usage.prompt_tokens_details.cached_tokens, text) of a greedy completion."""
    out = sync_client(live).completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, extra_body=NO_EOS
    )
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    return out.usage.prompt_tokens_details.cached_tokens or 0, out.choices[0].text


def tier_files(pid: int) -> list[Path]:
    """The shared-memory files a server of `pid` made."""
    return list(Path("/dev/shm").glob(f"pagoda-kv-{pid}-*"))


@pytest.mark.timeout(600)
def test_dp2_replicas_share_the_host_tier_and_it_outlives_a_restart(model_dir: Path) -> None:
    """Round robin sends the same prompt to each replica in turn: the second one gets the first one's prefix
    from the host tier (same text), streamed usage counts it, and so does a replica restarted after SIGKILL."""
    flags = (
        *CORE_FLAGS,
        "--data-parallel-size",
        "2",
        "--routing-policy",
        "round_robin",
        "--kv-offloading-size",
        "0.05",
    )
    with serving(model_dir, *flags, ready_timeout=READY_S) as live:
        pid = live.process.pid
        assert len(tier_files(pid)) == 1
        first, text = cached_tokens(live, [*PREFIX, 300])
        second, text2 = cached_tokens(live, [*PREFIX, 300])
        assert (first, second) == (0, 256) and text2 == text
        stream = sync_client(live).completions.create(
            model=MODEL,
            prompt=[*PREFIX, 301],
            max_tokens=2,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=NO_EOS,
        )
        usage = [chunk.usage for chunk in stream if chunk.usage is not None]
        assert usage and usage[0].prompt_tokens_details is not None
        assert usage[0].prompt_tokens_details.cached_tokens == 256
        # Kill both replicas: the restarted ones have empty pools, the tier still serves the prefix.
        for core in _core_pids(live):
            os.kill(core, signal.SIGKILL)
        time.sleep(1.0)
        wait_replicas_alive(live, 2, READY_S, "the replicas did not come back")
        assert cached_tokens(live, [*PREFIX, 302])[0] == 256
    assert not tier_files(pid)  # the server removed its file at exit


@pytest.mark.parametrize(
    ("flags", "name"),
    [
        (["--kv-offloading-size", "-1"], "kv_offloading_size"),
        (["--kv-offloading-size", "100000"], "--kv-offloading-size"),
        (["--kv-offloading-disk-path", "/tmp"], "kv_offloading_disk_size"),
        (
            ["--kv-offloading-disk-path", "/etc/hostname", "--kv-offloading-disk-size", "1"],
            "--kv-offloading-disk-path",
        ),
        (
            ["--kv-offloading-disk-path", "/tmp/pagoda-kv-t", "--kv-offloading-disk-size", "1e9"],
            "--kv-offloading-disk-size",
        ),
    ],
)
def test_bad_tier_flags_exit_2_naming_the_flag(flags: list[str], name: str, model_dir: Path) -> None:
    """A negative or absurd size, a disk path without its size, a disk path that is a file: exit 2 before
    anything loads."""
    done = subprocess.run(
        [sys.executable, "-m", "pagoda.server.cli", "serve", str(model_dir), *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert name in done.stderr


def test_no_tier_file_is_left_by_a_refused_start(model_dir: Path) -> None:
    """A start refused after the tier file was named leaves no file behind."""
    before = set(Path("/dev/shm").glob("pagoda-kv-*"))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagoda.server.cli",
            "serve",
            str(model_dir),
            "--kv-offloading-size",
            "0.01",
            "--max-model-len",
            "100000000",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert set(Path("/dev/shm").glob("pagoda-kv-*")) <= before
    assert psutil.pid_exists(os.getpid())
