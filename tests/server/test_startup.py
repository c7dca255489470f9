"""Start-up: /health says 200 only once the engine answers a completion, every phase of the start is logged, the
work moved after the start (the prompt-length bound) still happens; tools/bench_startup.py's phase table.

No timing is asserted here (tools/bench_startup.py measures it; the README has the table)."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from pagoda.server.api.server import listen_socket
from pagoda.server.startup import PHASE_FORMAT, process_age
from pagoda.server.testing import free_port, make_tiny_model, serve_command
from tool_scripts import load_tool

bench_startup = load_tool("bench_startup.py")

# Every phase an in-process start logs (pagoda.server.startup), in the order they end (the tokenizer's thread
# may end before or after the weights).
PHASES = {
    "python and imports",
    "device and dtype",
    "kernels",
    "tokenizer",
    "weights",
    "packed weights",
    "KV pool",
    "engine",
    "API app",
    "gc freeze",
    "HTTP server listening",
}


def test_process_age_counts_from_the_process_start() -> None:
    """A fresh interpreter's age at its first statement is positive and at most its whole run's wall time, plus
    one clock tick (the kernel stamps a process's start in ticks, 10 ms at 100 Hz)."""
    start = time.monotonic()
    code = "from pagoda.server.startup import process_age; print(process_age())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    age = float(out.stdout)
    assert 0 < age <= time.monotonic() - start + 1 / os.sysconf("SC_CLK_TCK")
    assert process_age() > 0


def test_health_is_200_only_once_a_completion_is_answered(tmp_path: Path) -> None:
    """From the spawn on, /health is refused (not listening yet) until its first answer, which is 200; a
    one-token completion sent at once is answered. The log holds every start-up phase, and the prompt-length
    bound computed after the start applies (an overlong prompt is refused for its characters, untokenized)."""
    model = make_tiny_model("llama", tmp_path / "llama")
    port = free_port()
    log = tmp_path / "serve.log"
    command = serve_command(model, ["--log-level", "info"], port=port)
    with open(log, "wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    try:
        answers: list[int] = []
        deadline = time.monotonic() + 300
        while not answers or answers[-1] != 200:
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline
            try:
                answers.append(httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code)
            except httpx.TransportError:
                time.sleep(0.02)
        assert answers == [200]  # the first answer: nothing listens before the engine is ready
        body = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 1
        assert set(bench_startup.parse_phases(log.read_text(errors="replace"))) == PHASES
        # The bound: the tiny tokenizer's longest token times max_model_len (256) characters at most.
        overlong = {"prompt": "z" * 200_000, "max_tokens": 1}
        deadline = time.monotonic() + 30
        while True:
            refused = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=overlong, timeout=60)
            assert refused.status_code == 400
            if "characters" in refused.json()["error"]["message"]:
                break
            assert time.monotonic() < deadline, refused.json()
            time.sleep(0.1)
    finally:
        process.terminate()
        process.wait(60)


def test_the_listen_socket_holds_the_port_and_refuses_connections_until_served() -> None:
    """`listen_socket` binds without listening: a connection is refused (as /health is before the engine is
    ready), and no other socket, an ephemeral one included, can bind the port while it is held."""
    with listen_socket("127.0.0.1", 0) as held:
        port = held.getsockname()[1]
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        # The kernel hands out ephemeral ports from the same range; none of these may be the held one.
        for _ in range(200):
            with socket.socket() as ephemeral:
                ephemeral.bind(("127.0.0.1", 0))
                assert ephemeral.getsockname()[1] != port


def test_a_port_in_use_fails_the_start_before_the_model_loads(tmp_path: Path) -> None:
    """`pagoda serve` on a port another process listens on exits 1 naming the address, before any weight is read
    (the port is bound first, so that nothing the start creates can take it either)."""
    model = make_tiny_model("llama", tmp_path / "llama")
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        command = serve_command(model, ["--log-level", "info"], port=port)
        out = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr
    assert "startup weights" not in out.stderr and "startup python and imports" in out.stderr


# Runs `pagoda serve` in a fresh interpreter with the HTTP server stubbed out: whether the cyclic collector runs
# while the engine starts and once it serves, and how many objects the freeze moved out of its sight.
_GC_PROBE = """
import gc, json, sys
import pagoda.server.api.server as server
import pagoda.server.cli as cli
seen = {}
start_engine = cli.start_engine
def starting(config):
    seen["starting"] = gc.isenabled()
    return start_engine(config)
def serving(app, llm, config, sock):
    seen["serving"] = gc.isenabled()
    seen["frozen"] = gc.get_freeze_count()
    return 0
cli.start_engine = starting
server.run_server = serving
status = cli.main(["serve", sys.argv[1], "--max-model-len", "64", "--kv-cache-gib", "0.01"])
print(json.dumps({"status": status, **seen}))
"""


def test_the_collector_is_off_while_starting_and_on_while_serving(tmp_path: Path) -> None:
    """`serve` turns cyclic garbage collection off for the start (its collections found nothing worth ~0.15-0.3 s)
    and back on, after freezing what the start loaded, before it serves."""
    model = make_tiny_model("llama", tmp_path / "llama")
    out = subprocess.run(
        [sys.executable, "-c", _GC_PROBE, str(model)], capture_output=True, text=True, timeout=300, check=True
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["status"] == 0
    assert seen["starting"] is False and seen["serving"] is True
    assert seen["frozen"] > 10_000  # torch, transformers and the engine's objects


def test_bench_startup_reads_the_phase_lines_into_a_table_of_medians() -> None:
    """The tool parses the server's phase lines and prints each phase's median over the runs, ordered by when
    it ended, then the /health 200 and completion medians."""
    logs = [
        "\n".join(
            [
                "INFO pagoda.startup: " + PHASE_FORMAT % ("python and imports", imports, imports),
                "INFO pagoda.startup: " + PHASE_FORMAT % ("weights", 1.0, imports + 1.0),
                "INFO other: noise",
            ]
        )
        for imports in (1.5, 2.0, 1.75)
    ]
    phases = [bench_startup.parse_phases(log) for log in logs]
    assert phases[0] == {"python and imports": (1.5, 1.5), "weights": (1.0, 2.5)}
    runs = [bench_startup.Run(3.0 + i, 0.1, p) for i, p in enumerate(phases)]
    rows = bench_startup.table(runs).splitlines()
    assert rows[2] == "| python and imports | 1.75 | 1.75 |"
    assert rows[3] == "| weights | 1.00 | 2.75 |"
    assert "**4.00**" in rows[4] and "| 0.10 |" in rows[5]


def test_bench_startup_runs_against_a_live_server(capsys: pytest.CaptureFixture[str]) -> None:
    """One measured start of the tiny model: the table has every phase and the /health row."""
    assert bench_startup.main(["--model", "tiny", "--runs", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    for phase in PHASES:
        assert f"| {phase} |" in out
    assert "/health 200" in out
