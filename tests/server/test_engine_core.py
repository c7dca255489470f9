"""Engine cores in their own processes: frames, deltas, one core process and data-parallel replicas.

The live tests run `pagoda serve` with `--engine-core process` or `--data-parallel-size 2` over a tiny model and
drive it with the official OpenAI client: the same greedy tokens as in-process, cancellations that leave every
replica idle, and a replica killed mid-stream.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import psutil
import pytest
from api_cases import MODEL
from pagoda.server.async_llm import AsyncLLM
from pagoda.server.cli import build_parser, engine_config, serve_config
from pagoda.server.config import EngineConfig, ServingConfig
from pagoda.server.core import CoreClient, CoreStartupError
from pagoda.server.core.deltas import DeltaDecoder, DeltaEncoder
from pagoda.server.core.messages import AddRequest, input_decoder, output_decoder
from pagoda.server.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagoda.server.procs import ProcessLauncher, pinned_cpus
from pagoda.server.routing import build_router
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import make_tiny_model
from test_api_live import NO_EOS, LiveServer, cut_off_requests, serving, sync_client

MAX_MODEL_LEN = 2048
PROMPTS = ["The quick brown fox", "Hello world! How are", "A paged cache splits", "Tokens, blocks, tables"]
# Engine cores start a fresh interpreter each (torch, transformers): on a busy 2-core machine that takes a while.
READY_S = 300
CORE_FLAGS = ("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16", "--log-level", "info")


def _snapshot(tokens: tuple[int, ...], text: str, finished: bool) -> RequestOutput:
    logprobs = tuple({t: Logprob(-0.5, 1, str(t))} for t in tokens)
    sample = CompletionOutput(0, text, tokens, -1.0, logprobs, "length" if finished else None)
    return RequestOutput("r", None, (1, 2), (sample,), finished, RequestMetrics(arrival_time=1.0))


def test_deltas_rebuild_every_snapshot() -> None:
    """Appends, a shortened text (a stop string cut) and a rewritten token list (a beam) all round-trip."""
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    decoder.add("r", "prompt", [1, 2])
    snapshots = [
        _snapshot((5,), "a", False),
        _snapshot((5, 6, 7), "abc", False),
        _snapshot((5, 6, 7, 8), "ab", False),  # text cut back
        _snapshot((9, 6), "zz", True),  # rewritten
    ]
    frames = [msgspec.msgpack.encode(encoder.encode(s)) for s in snapshots]
    assert len(frames[2]) < len(msgspec.msgpack.encode(snapshots[2]))  # a delta, not the whole snapshot
    for snapshot, frame in zip(snapshots, frames, strict=True):
        rebuilt = decoder.decode(msgspec.msgpack.decode(frame, type=type(encoder.encode(snapshot))))
        assert rebuilt is not None
        assert rebuilt.outputs == snapshot.outputs and rebuilt.finished == snapshot.finished
        assert rebuilt.prompt == "prompt" and rebuilt.prompt_token_ids == (1, 2)
    assert decoder.decode(encoder.encode(snapshots[0])) is None  # forgotten once finished


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1garbage",
        msgspec.msgpack.encode({"type": "AddRequest"}),
        msgspec.msgpack.encode({"type": "Unknown", "request_ids": []}),
        msgspec.msgpack.encode(
            {"type": "AddRequest", "request_id": "x", "prompt_token_ids": [1], "params": {"n": 0}}
        ),
    ],
)
def test_malformed_frames_do_not_decode(frame: bytes, caplog: pytest.LogCaptureFixture) -> None:
    """Garbage, a missing field, an unknown tag and an invalid parameter are all dropped with a log line."""
    with caplog.at_level(logging.WARNING):
        assert input_decoder().decode_or_none(frame) is None
        assert output_decoder().decode_or_none(frame) is None
    assert "malformed" in caplog.text


@pytest.mark.parametrize(
    ("cores", "replicas", "expected"),
    [
        (2, 1, [(1,)]),  # the first core is left to the front end
        (2, 2, [(0,), (1,)]),  # one each, the front end shares them
        (8, 2, [(1, 2, 3), (4, 5, 6)]),
        (1, 2, [None, None]),  # fewer cores than replicas: no pinning
    ],
)
def test_replicas_get_disjoint_cores(
    cores: int, replicas: int, expected: list[tuple[int, ...] | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Disjoint core sets per replica, one core left to the front end when there are more cores than replicas."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert [pinned_cpus(i, replicas) for i in range(replicas)] == expected


@pytest.mark.timeout(120)
def test_core_that_cannot_load_is_a_clear_startup_error(tmp_path: Path) -> None:
    """A core whose model does not load sends `Failed`; the client raises CoreStartupError saying why."""
    config = EngineConfig.from_flat(model=str(tmp_path / "no-such-model"), num_kv_blocks=16)
    with pytest.raises(CoreStartupError, match=r"engine core 0 failed to start: .*no-such-model"):
        CoreClient(config, ProcessLauncher(1, logging.INFO), build_router("round_robin", 1, 16), 1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a 4096-token context."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama", max_position_embeddings=4096)


@pytest.mark.timeout(600)
def test_core_survives_malformed_frames(model_dir: Path) -> None:
    """Frames that do not decode, sent straight to a core's input socket, are dropped; the core keeps serving."""
    config = EngineConfig.from_flat(
        model=str(model_dir), num_kv_blocks=64, dtype="float32", max_model_len=256
    )
    client = CoreClient(config, ProcessLauncher(1, logging.INFO), build_router("round_robin", 1, 16), 1)
    try:
        inputs = client.replicas[0].inputs
        assert inputs is not None
        inputs.send(b"\xc1not msgpack")
        inputs.send(msgspec.msgpack.encode({"type": "AddRequest", "request_id": "bad", "params": {"n": 0}}))
        inputs.send(msgspec.msgpack.encode(AddRequest("ok", [5, 6, 7], SamplingParams(max_tokens=4))))

        async def generate() -> RequestOutput:
            llm = AsyncLLM(client, ServingConfig(served_model_name=MODEL))
            llm.start()
            try:
                last = None
                params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
                async for output in llm.generate("after", [5, 6, 7], params):
                    last = output
                assert last is not None
                return last
            finally:
                await asyncio.to_thread(llm.shutdown)

        output = asyncio.run(generate())
        assert len(output.outputs[0].token_ids) == 6
        handle = client.replicas[0].handle
        assert handle is not None and handle.is_alive() and client.replicas[0].restarts == 0
    finally:
        client.close()


def _greedy_all(live: LiveServer) -> list[list[str]]:
    client = sync_client(live)
    texts = []
    for prompt in PROMPTS:
        result = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, n=1, extra_body=NO_EOS
        )
        texts.append([result.choices[0].text])
    batch = client.completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0, extra_body=NO_EOS
    )
    texts.append([c.text for c in sorted(batch.choices, key=lambda c: c.index)])
    return texts


@pytest.fixture(scope="module")
def inproc_greedy(model_dir: Path) -> list[list[str]]:
    """The greedy texts of the in-process server."""
    with serving(model_dir, *CORE_FLAGS, ready_timeout=READY_S) as live:
        return _greedy_all(live)


def _replica_cpus() -> tuple[str, list[set[int]]]:
    """dp2's `--replica-cpus` and the CPU sets it gives: core 0 every CPU of the first two, core 1 the second
    (unlike the automatic split, one each), or both the one CPU there is."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    return ",".join(map(str, cpus)) + f";{cpus[-1]}", [set(cpus), {cpus[-1]}]


REPLICA_CPUS, REPLICA_CPU_SETS = _replica_cpus()


@pytest.fixture(scope="module")
def dp2(model_dir: Path) -> Iterator[LiveServer]:
    """A server of two engine-core replicas, round robin (so both serve), with small KV pools."""
    flags = (
        *CORE_FLAGS,
        "--data-parallel-size",
        "2",
        "--routing-policy",
        "round_robin",
        "--replica-cpus",
        REPLICA_CPUS,
    )
    with serving(model_dir, *flags, ready_timeout=READY_S) as live:
        yield live
        cores = [psutil.Process(pid) for pid in _core_pids(live)]
    # SIGTERM drained the server (exit status 0, asserted by `serving`), and its cores exited with it.
    _, alive = psutil.wait_procs(cores, timeout=30)
    assert not alive


@pytest.mark.timeout(600)
def test_one_core_process_gives_inproc_greedy_tokens(model_dir: Path, inproc_greedy: list[list[str]]) -> None:
    """`--engine-core process`: the same greedy texts as in-process; /health counts one replica; the core exits
    by itself when the server is killed (no orphan)."""
    live = LiveServer(model_dir, *CORE_FLAGS, "--engine-core", "process", ready_timeout=READY_S)
    try:
        assert _greedy_all(live) == inproc_greedy
        health = httpx.get(f"{live.base_url}/health").json()
        assert health == {"status": "ok", "replicas": 1, "replicas_alive": 1}
        (core,) = [psutil.Process(pid) for pid in _core_pids(live)]
        live.process.kill()
        live.process.wait()
        core.wait(timeout=30)  # psutil.TimeoutExpired if the core outlived its parent
    finally:
        live.stop()


@pytest.mark.timeout(600)
def test_dp2_gives_inproc_greedy_tokens(dp2: LiveServer, inproc_greedy: list[list[str]]) -> None:
    """Two replicas: the same greedy texts, both replicas served some, the router counted its choices."""
    assert _greedy_all(dp2) == inproc_greedy
    text = httpx.get(f"{dp2.base_url}/metrics").text
    assert all(engine_metric(text, "pagoda:prompt_tokens_total", e) > 0 for e in ("0", "1"))
    assert metric_value(text, 'pagoda:router_prefix_misses_total{model_name="' + MODEL + '"}') == 0.0
    assert httpx.get(f"{dp2.base_url}/health").json() == {"status": "ok", "replicas": 2, "replicas_alive": 2}


def metric_value(text: str, series: str) -> float:
    """The value of one exact series line in a Prometheus exposition."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} not in /metrics")


def engine_metric(text: str, name: str, engine: str) -> float:
    """The value of `name` for replica `engine`."""
    for line in text.splitlines():
        if line.startswith(name + "{") and f'engine="{engine}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} of engine {engine} not in /metrics")


def wait_idle(live: LiveServer, engines: tuple[str, ...] = ("0", "1")) -> list[list[float]]:
    """Each replica's (running, waiting, KV usage) once all are 0, or after 30 s."""
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(f"{live.base_url}/metrics").text
        state = [
            [
                engine_metric(text, f"pagoda:{name}", e)
                for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
            ]
            for e in engines
        ]
        if all(s == [0, 0, 0] for s in state) or time.monotonic() > deadline:
            return state
        time.sleep(0.1)


@pytest.mark.timeout(600)
def test_dp2_cancellation_storm_leaves_every_replica_idle(dp2: LiveServer) -> None:
    """60 requests cut off by the client over two replicas: afterwards no replica runs, waits or holds KV."""

    assert asyncio.run(cut_off_requests(dp2, 60, 1000, lambda i: 0.2 + 0.01 * i)) > 0
    assert wait_idle(dp2) == [[0, 0, 0], [0, 0, 0]]


def _core_pids(live: LiveServer) -> list[int]:
    server = psutil.Process(live.process.pid)
    return [
        child.pid
        for child in server.children()
        if "pagoda.server.core" in " ".join(child.cmdline()) and child.is_running()
    ]


def wait_replicas_alive(live: LiveServer, count: int, seconds: float, failure: str) -> None:
    """Poll /health until it counts `count` live replicas; fail with `failure` after `seconds`."""
    deadline = time.monotonic() + seconds
    while httpx.get(f"{live.base_url}/health").json().get("replicas_alive") != count:
        assert time.monotonic() < deadline, failure
        time.sleep(0.05)


@pytest.mark.timeout(600)
def test_dp2_replica_killed_mid_stream(dp2: LiveServer) -> None:
    """SIGKILL one replica while four streams run: its streams end at once with an OpenAI error, the others
    finish; new requests are served meanwhile; the replica comes back; nothing is left on either."""
    client = sync_client(dp2)
    results: dict[int, Any] = {}
    started = threading.Barrier(5)

    def stream(i: int) -> None:
        try:
            events = client.completions.create(
                model=MODEL,
                prompt=f"story {i}",
                max_tokens=1500,
                temperature=0,
                stream=True,
                extra_body=NO_EOS,
            )
            first = True
            count = 0
            for chunk in events:
                count += len(chunk.choices)
                if first:
                    first = False
                    started.wait(60)
            results[i] = count
        except openai.APIError as exc:
            results[i] = exc

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    started.wait(60)
    pids = _core_pids(dp2)
    assert len(pids) == 2
    killed_at = time.monotonic()
    os.kill(pids[0], signal.SIGKILL)
    wait_replicas_alive(dp2, 1, 30, "the killed replica was not noticed")
    # New requests go to the live replica (round robin skips the dead one) while the dead one restarts.
    for _ in range(3):
        result = client.completions.create(model=MODEL, prompt="still here", max_tokens=4, extra_body=NO_EOS)
        assert result.choices[0].finish_reason == "length"
    for thread in threads:
        thread.join(120)
    failed = [r for r in results.values() if isinstance(r, openai.APIError)]
    finished = [r for r in results.values() if isinstance(r, int)]
    assert len(failed) == 2 and len(finished) == 2, results
    assert all("replica" in str(r) for r in failed)
    assert time.monotonic() - killed_at < 60
    wait_replicas_alive(dp2, 2, 120, "the killed replica did not come back")
    text = httpx.get(f"{dp2.base_url}/metrics").text
    assert sum(engine_metric(text, "pagoda:engine_restarts_total", e) for e in ("0", "1")) == 1
    assert wait_idle(dp2) == [[0, 0, 0], [0, 0, 0]]
    assert client.completions.create(model=MODEL, prompt="back", max_tokens=2).choices[0].text is not None


@pytest.mark.timeout(600)
def test_dp2_replica_killed_while_idle_is_noticed_and_restarted(dp2: LiveServer) -> None:
    """SIGKILL one replica while no request runs: /health counts it dead without any request (the idle health
    check), then it restarts, and requests are served by both again."""
    assert wait_idle(dp2) == [[0, 0, 0], [0, 0, 0]]
    text = httpx.get(f"{dp2.base_url}/metrics").text
    restarts = sum(engine_metric(text, "pagoda:engine_restarts_total", e) for e in ("0", "1"))
    pids = _core_pids(dp2)
    # --replica-cpus pinned each core to its list; the restarted core keeps the killed one's.
    pinned = {pid: os.sched_getaffinity(pid) for pid in pids}
    assert sorted(map(sorted, pinned.values())) == sorted(map(sorted, REPLICA_CPU_SETS))
    os.kill(pids[1], signal.SIGKILL)
    wait_replicas_alive(dp2, 1, 30, "the replica that died while idle was not noticed")
    wait_replicas_alive(dp2, 2, 120, "the killed replica did not come back")
    (new_pid,) = set(_core_pids(dp2)) - set(pids)
    assert os.sched_getaffinity(new_pid) == pinned[pids[1]]
    text = httpx.get(f"{dp2.base_url}/metrics").text
    assert sum(engine_metric(text, "pagoda:engine_restarts_total", e) for e in ("0", "1")) == restarts + 1
    client = sync_client(dp2)
    for _ in range(2):
        assert (
            client.completions.create(model=MODEL, prompt="again", max_tokens=2).choices[0].text is not None
        )


@pytest.mark.timeout(600)
def test_ray_dp2_gives_inproc_greedy_tokens(
    model_dir: Path, inproc_greedy: list[list[str]], ray_cluster: str
) -> None:
    """`--distributed-executor-backend ray --data-parallel-size 2` on a local cluster: the same greedy texts."""
    flags = (*CORE_FLAGS, "--distributed-executor-backend", "ray", "--data-parallel-size", "2")
    with serving(model_dir, *flags, "--routing-policy", "round_robin", ready_timeout=READY_S) as live:
        assert _greedy_all(live) == inproc_greedy
        text = httpx.get(f"{live.base_url}/metrics").text
        assert all(engine_metric(text, "pagoda:prompt_tokens_total", e) > 0 for e in ("0", "1"))


def _prompt_tokens(live: LiveServer) -> list[float]:
    text = httpx.get(f"{live.base_url}/metrics").text
    return [engine_metric(text, "pagoda:prompt_tokens_total", e) for e in ("0", "1")]


@pytest.mark.timeout(600)
def test_dp2_cache_aware_routes_a_shared_prefix_to_its_replica(model_dir: Path) -> None:
    """`--routing-policy cache_aware` (the default): a request sharing a 256-token prefix with an earlier one lands
    on the replica that computed it (its blocks are cached there), and 16 distinct prefixes use both replicas."""
    flags = (*CORE_FLAGS, "--data-parallel-size", "2")
    with serving(model_dir, *flags, ready_timeout=READY_S) as live:
        client = sync_client(live)
        prefix = [10 + i for i in range(256)]  # 16 full blocks of 16 tokens
        first = client.completions.create(
            model=MODEL, prompt=[*prefix, 300, 301], max_tokens=2, temperature=0
        )
        before = _prompt_tokens(live)
        second = client.completions.create(
            model=MODEL, prompt=[*prefix, 350, 351], max_tokens=2, temperature=0
        )
        after = _prompt_tokens(live)
        assert first.usage is not None and first.usage.prompt_tokens_details is not None
        assert second.usage is not None and second.usage.prompt_tokens_details is not None
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert second.usage.prompt_tokens_details.cached_tokens == 256
        # Only the replica holding the prefix computed the second prompt's tail.
        assert sorted(a - b for a, b in zip(after, before, strict=True)) == [0, 2]
        text = httpx.get(f"{live.base_url}/metrics").text
        assert metric_value(text, 'pagoda:router_prefix_hits_total{model_name="' + MODEL + '"}') == 1.0
        start = _prompt_tokens(live)
        for p in range(16):
            distinct = [300 + p] + [
                20 + i for i in range(31)
            ]  # two full blocks, its own from the first token
            client.completions.create(model=MODEL, prompt=distinct, max_tokens=1, temperature=0)
        spread = [a - b for a, b in zip(_prompt_tokens(live), start, strict=True)]
        assert min(spread) >= 4 * 32, spread  # each replica computed several of the 16 prefixes


@pytest.mark.timeout(600)
def test_core_process_with_tensor_parallel_workers(model_dir: Path, inproc_greedy: list[list[str]]) -> None:
    """DP x TP compose: an engine-core process whose engine splits the model over 2 ranks (one worker process of
    its own) gives the in-process greedy texts."""
    flags = (*CORE_FLAGS, "--engine-core", "process", "--tensor-parallel-size", "2")
    with serving(model_dir, *flags, ready_timeout=READY_S) as live:
        assert _greedy_all(live) == inproc_greedy


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--data-parallel-size", "0"], "--data-parallel-size must be >= 1"),
        (["--engine-ready-timeout", "0"], "--engine-ready-timeout must be > 0"),
    ],
)
def test_parallel_flags_are_checked(flags: list[str], message: str) -> None:
    """Out-of-range replica flags are refused before anything starts; the defaults keep the engine in-process."""
    parser = build_parser()
    defaults = parser.parse_args(["serve"])
    assert (defaults.engine_core, defaults.data_parallel_size, defaults.routing_policy) == (
        "inproc",
        1,
        "cache_aware",
    )
    assert (
        engine_config(
            parser.parse_args(["serve", "--distributed-executor-backend", "ray"])
        ).parallel_config.distributed_executor_backend
        == "ray"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        serve_config(parser.parse_args(["serve", *flags]))
