"""Slow readers (issue 28, item 1): a client that asks for a long streamed `n = 4` response with logprobs and never
reads it costs the server one snapshot per stream, not one per step, and with --stream-stall-timeout it is
aborted (its KV freed, the abort counted) while the server keeps serving.

The hostile client is a raw socket with a small receive buffer that never calls recv, so the server's writes
back up into uvicorn's flow control after a few hundred steps."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil
import pytest
from api_cases import MODEL
from api_fake_engine import FakeEngine, serve_in_thread
from pagoda.server import testing
from pagoda.server.async_llm import AsyncLLM
from pagoda.server.outputs import RequestOutput
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import make_tiny_model
from raw_http import post_head

ROOT = Path(__file__).resolve().parents[2]
MB = 2**20
# What the never-reading client asks for: four long samples with 20 alternatives per token, so that each step's
# SSE chunks are kilobytes and the socket buffers fill early.
HOSTILE = {"model": MODEL, "prompt": "abc", "n": 4, "logprobs": 20, "stream": True}


@contextmanager
def never_reading(base_url: str, body: dict[str, Any]) -> Iterator[socket.socket]:
    """A connection with a small receive window that sends `body` to /v1/completions and reads nothing itself
    (the caller may read the socket slowly)."""
    address = urlsplit(base_url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # set before connecting: a small window
    try:
        sock.connect((address.hostname or "127.0.0.1", address.port or 80))
        payload = json.dumps(body).encode()
        sock.sendall(post_head("/v1/completions", b"", len(payload)) + payload)
        yield sock
    finally:
        sock.close()


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `condition` every 50 ms until it holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class _Tracked(RequestOutput):
    """A snapshot that can be weakly referenced (no __slots__), so that a test can count the live ones."""


class TrackingEngine(FakeEngine):
    """The fake engine, keeping a weak reference to every snapshot it makes: `live` counts those still held."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._lock = threading.Lock()  # snapshots die on whichever thread drops the last reference
        self._live = 0

    def step(self) -> list[RequestOutput]:
        """The fake's step, its snapshots tracked."""
        outputs: list[RequestOutput] = []
        for output in super().step():
            tracked = _Tracked(**{f.name: getattr(output, f.name) for f in fields(output)})
            with self._lock:
                self._live += 1
            weakref.finalize(tracked, self._forget)
            outputs.append(tracked)
        return outputs

    def _forget(self) -> None:
        with self._lock:
            self._live -= 1

    @property
    def live(self) -> int:
        """Snapshots of this engine still referenced anywhere."""
        with self._lock:
            return self._live


def assert_good_request(base_url: str) -> None:
    """A plain request succeeds."""
    response = httpx.post(
        f"{base_url}/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 2}
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_a_reader_that_never_reads_holds_one_snapshot_per_stream() -> None:
    """Thousands of steps into a response nobody reads, the server holds a handful of snapshots (the latest per
    stream), not one per step: the count stays flat between step 1,500 and step 3,000. Without the latest-only
    box and the bounded merge queue, every step's snapshot stays queued (thousands)."""
    engine = TrackingEngine(max_model_len=100_000)
    with serve_in_thread(engine, stream_stall_timeout=None) as running:
        with never_reading(running.base_url, {**HOSTILE, "max_tokens": 50_000}):
            wait_for(lambda: engine.num_steps >= 1500, 120, "1,500 engine steps")
            early = engine.live
            wait_for(lambda: engine.num_steps >= 3000, 120, "3,000 engine steps")
            late = engine.live
            assert late < 20 and early < 20, (early, late)
            assert running.llm.num_buffered_outputs <= 3
        wait_for(lambda: running.llm.num_active_requests == 0, 30, "the disconnect's abort")
        # The front end forgets the stream first; the engine thread takes the abort at its next step.
        wait_for(lambda: not engine.requests, 30, "the engine's abort")
        assert_good_request(running.base_url)


def test_a_stalled_reader_is_aborted_and_frees_its_kv() -> None:
    """With --stream-stall-timeout 0.5 the never-read request is aborted within seconds of its socket backing
    up: the engine drops it (KV back to 0), all four samples count as `abort` in /metrics, and a good request is
    served while the hostile connection is still open."""
    engine = FakeEngine(max_model_len=100_000)
    with serve_in_thread(engine, stream_stall_timeout=0.5) as running:
        with never_reading(running.base_url, {**HOSTILE, "max_tokens": 50_000}):
            wait_for(lambda: len(engine.aborted) == 1, 60, "the stalled reader's abort")
            assert running.llm.num_stalled_aborts == 1 and not engine.requests
            assert engine.get_stats().kv_cache_usage == 0
            metrics = httpx.get(f"{running.base_url}/metrics").text
            assert (
                'pagoda:request_success_total{finished_reason="abort",model_name="test-model"} 4.0' in metrics
            )
            assert_good_request(running.base_url)
        wait_for(lambda: running.llm.num_active_requests == 0, 30, "the closed connection's release")
        assert running.llm.num_stalled_aborts == 1  # the good request was not taken for a stalled one
        assert_good_request(running.base_url)


def test_a_slow_reader_is_not_a_stalled_one() -> None:
    """A reader that pauses, then reads, is never aborted: the stall clock measures a snapshot left unread, and
    each read resets it. The stream runs past the stall timeout (4 s of steps against 2 s), so a clock that never
    reset would abort it. The reader gets every token of every sample."""
    engine = FakeEngine(max_model_len=2000, step_seconds=0.004)
    with serve_in_thread(engine, stream_stall_timeout=2.0) as running:
        data = bytearray()
        with never_reading(running.base_url, {**HOSTILE, "max_tokens": 1000}) as sock:
            sock.settimeout(30)
            time.sleep(1.0)  # the buffers fill and a snapshot waits unread, within the timeout
            while b"data: [DONE]" not in data[-64:]:
                chunk = sock.recv(65536)
                assert chunk, "the server closed the stream early"
                data += chunk
        events = [json.loads(e) for e in sse_data(bytes(data)) if e != "[DONE]"]
        texts = ["", "", "", ""]
        finish: list[str | None] = [None] * 4
        for event in events:
            (choice,) = event["choices"]
            texts[choice["index"]] += choice["text"]
            finish[choice["index"]] = choice["finish_reason"] or finish[choice["index"]]
        prompt_ids = engine.tokenizer.encode("abc")
        assert texts == [engine.expected_text(prompt_ids, 1000, index=i) for i in range(4)]
        assert finish == ["length"] * 4
        assert running.llm.num_stalled_aborts == 0


def sse_data(response: bytes) -> list[str]:
    """The `data:` payloads of a chunked HTTP/1.1 event-stream response."""
    _, _, rest = response.partition(b"\r\n\r\n")
    body = bytearray()
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        body += rest[:size]
        rest = rest[size + 2 :]
    return [line[6:] for line in body.decode().split("\n\n") if line.startswith("data: ")]


def test_output_box_keeps_order_and_only_the_latest_snapshot() -> None:
    """The acceptance, then the newest of several unread snapshots, then the error, in that order; the stall
    clock runs from the first unread snapshot and stops when one is read."""
    from pagoda.server.client_stream import RequestAccepted, RequestFailed
    from pagoda.server.output_box import OutputBox

    async def scenario() -> None:
        box = OutputBox(asyncio.get_running_loop())
        snapshots = [_snapshot(i) for i in range(5)]
        accepted = RequestAccepted("r")
        box.put(accepted)
        for i, snap in enumerate(snapshots):
            box.put(snap, now=10.0 + i)
        assert len(box) == 2 and box.unread_for(20.0) == 10.0
        error = RequestFailed("r", RuntimeError("boom"))
        box.put(error)
        assert await box.get() is accepted
        assert await box.get() is snapshots[-1]
        assert box.unread_for(20.0) == 0.0
        assert await box.get() is error
        waiter = asyncio.ensure_future(box.get())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        await asyncio.get_running_loop().run_in_executor(None, box.put, snapshots[0])  # another thread
        assert await asyncio.wait_for(waiter, 5) is snapshots[0]

    asyncio.run(scenario())


def _snapshot(i: int) -> RequestOutput:
    from pagoda.server.outputs import CompletionOutput, RequestMetrics

    sample = CompletionOutput(
        index=0, text="x" * i, token_ids=(1,) * i, cumulative_logprob=None, logprobs=None
    )
    return RequestOutput("r", None, (1,), (sample,), False, RequestMetrics(arrival_time=0.0))


def test_async_llm_counts_a_beam_search_by_its_width() -> None:
    """--max-waiting-requests counts a beam search's beams, not its n: width 8 over a limit of 4 can never be
    admitted (a 400 naming best_of, not n)."""
    from pagoda.server.beam_search import BeamSearchParams
    from pagoda.server.config import ServingConfig
    from pagoda.server.engine import RequestRejectedError

    llm = AsyncLLM(FakeEngine(), ServingConfig(max_waiting_requests=4))
    params = SamplingParams.for_beam_search(BeamSearchParams(beam_width=8, max_tokens=4), n=1)
    assert params.num_sequences == 8

    async def scenario() -> None:
        from pagoda.server.async_llm import PromptRequest

        with pytest.raises(RequestRejectedError) as caught:
            await llm.add_requests([PromptRequest("r", [1, 2])], params)
        assert caught.value.param == "best_of"

    asyncio.run(scenario())


# --- the real server ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a 4096-token context."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama", max_position_embeddings=4096)


def _metric(text: str, prefix: str) -> float:
    """The value of the first sample whose line starts with `prefix`, 0 when there is none yet."""
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_live_server_aborts_a_stalled_reader_and_keeps_its_memory(model_dir: Path) -> None:
    """`pagoda serve --stream-stall-timeout 1` on a tiny model: a client asking for 3,000 tokens x n = 4 with
    logprobs and never reading is aborted (4 aborted samples in /metrics, KV usage back to 0, nothing running),
    the server's RSS grows by less than 200 MB meanwhile, and a good request succeeds afterwards."""
    flags = ["--kv-cache-gib", "0.05", "--dtype", "float32", "--stream-stall-timeout", "1"]
    with testing.LiveServer(model_dir, flags, served_model_name=MODEL, ready_timeout=120, cwd=ROOT) as live:
        process = psutil.Process(live.process.pid)
        before = process.memory_info().rss
        peak = before
        abort_line = 'pagoda:request_success_total{finished_reason="abort"'
        body = {**HOSTILE, "prompt": "hello there", "max_tokens": 3000, "ignore_eos": True}
        with never_reading(live.base_url, body):

            def aborted() -> bool:
                nonlocal peak
                peak = max(peak, process.memory_info().rss)
                return _metric(httpx.get(f"{live.base_url}/metrics").text, abort_line) == 4

            wait_for(aborted, 240, "the stalled reader's abort")
            text = httpx.get(f"{live.base_url}/metrics").text
            assert _metric(text, "pagoda:kv_cache_usage_perc") == 0
            assert _metric(text, "pagoda:num_requests_running") == 0
            assert _metric(text, 'pagoda:request_success_total{finished_reason="length"') == 0
            good = httpx.post(
                f"{live.base_url}/v1/completions",
                json={"model": MODEL, "prompt": "ok", "max_tokens": 4, "ignore_eos": True},
                timeout=120,
            )
            assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"] == "length"
        assert (peak - before) / MB < 200, (before / MB, peak / MB)
