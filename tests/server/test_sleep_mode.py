"""Sleep mode: `--enable-sleep-mode`, POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping, `--wake-on-request`
and `--sleep-idle-seconds`, in the engine and through real `pagoda serve` processes (in-process, and two
data-parallel engine cores).

Every sleep is checked by what it must change: the weights and the KV pool are gone while asleep (the model holds
no weight bytes, the server's RSS falls), greedy tokens after the wake equal those before, and no prefix block
cached before the sleep is served after it.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_fake_engine import FakeEngine, serve_in_thread
from pagoda.server.cli import main
from pagoda.server.client_stream import EngineSleepingError
from pagoda.server.config import EngineConfig
from pagoda.server.engine import LLMEngine
from pagoda.server.engine.sleep import SleepModeError, weight_slots
from pagoda.server.llm import LLM
from pagoda.server.models.quantized import resident_weight_bytes
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import LiveServer, make_tiny_model
from pagoda.server.testing.tiny_gguf import write_tiny_gguf

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Hello world! How are you today?"]
# A prompt of three full 16-token blocks and a few more tokens: the prefix cache keeps its three blocks.
PREFIX_PROMPT = list(range(5, 58))
CACHEABLE_TOKENS = 48
BLOCK = 16

# The live servers' tiny Llama has a wide KV (4 layers x 4 KV heads x head_dim 64, float32: 8 KiB per token), so
# that a few requests make most of the KV pool resident and the pool dominates the server's RSS change.
WIDE_KV = {"num_hidden_layers": 4, "num_key_value_heads": 4, "head_dim": 64}
KV_BYTES_PER_TOKEN = 4 * 2 * 4 * 64 * 4
KV_GIB = 0.25
POOL_BYTES = KV_GIB * 2**30
MB = 2**20


# ------------------------------------------------------------------------------------------------ the engine


def _asleep(engine: LLMEngine) -> bool:
    """engine.is_sleeping, read afresh (a call, so that mypy does not carry an earlier assert's narrowing)."""
    return engine.is_sleeping


def _greedy(llm: LLM) -> list[tuple[int, ...]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("level", [1, 2])
def test_engine_sleeps_and_wakes_with_the_same_greedy_tokens(
    tiny_model_path: Any, arch: str, level: int
) -> None:
    """Asleep, the model holds no weight bytes and the KV pool no tensor; after the wake the greedy tokens equal
    those before (float32 with packed oneDNN weights; gemma3: KV cache groups with sliding windows)."""
    llm = LLM(str(tiny_model_path(arch)), enable_sleep_mode=True, dtype="float32", kv_cache_gib=0.01)
    engine = llm.engine
    before = _greedy(llm)
    weights = resident_weight_bytes(engine.runner.model)
    assert weights > 0
    llm.sleep(level)
    assert _asleep(engine)
    assert resident_weight_bytes(engine.runner.model) == 0
    assert engine.runner.kv_cache.device_caches == [] and engine.runner.kv_cache.layer_caches == []
    llm.wake_up()
    assert not _asleep(engine)
    assert resident_weight_bytes(engine.runner.model) == weights
    assert _greedy(llm) == before


@pytest.mark.parametrize(
    "extra",
    [
        {"kv_manager": "contiguous"},
        {"preemption_mode": "swap", "swap_space_gib": 0.01},
        {"kv_cache_dtype": "int8"},
        {"speculative_config": "draft"},
    ],
    ids=["contiguous", "host-swap-tier", "int8-kv", "draft-model"],
)
def test_engine_sleep_covers_every_pool_and_the_draft_model(
    tiny_model_path: Any, extra: dict[str, Any]
) -> None:
    """A level-2 sleep and wake keep the greedy tokens with a contiguous pool, a host swap tier (freed too), an
    int8 KV pool (its scales too) and a draft model (its weights and pool sleep with the target's)."""
    path = str(tiny_model_path("llama"))
    if extra.get("speculative_config") == "draft":
        extra = {"speculative_config": {"method": "draft_model", "model": path, "num_speculative_tokens": 2}}
    llm = LLM(path, enable_sleep_mode=True, dtype="float32", kv_cache_gib=0.01, **extra)
    sleeping = llm.engine.sleeping
    assert sleeping is not None
    before = _greedy(llm)
    llm.sleep(2)
    for runner in sleeping.runners:
        assert runner.kv_cache is not None  # an engine's runners each have their pool
        assert runner.kv_cache.device_caches == [] and runner.kv_cache.host_caches == []
        assert resident_weight_bytes(runner.weights.model) == 0
    llm.wake_up()
    assert _greedy(llm) == before
    assert len(sleeping.runners) == (2 if "speculative_config" in extra else 1)


def test_engine_offload_round_trips_packed_and_quantized_weights(tmp_path: Path) -> None:
    """Level 1's offload (what CUDA does: host copies, here taken on the CPU) restores a quantized GGUF model's
    blocks and a packed model's oneDNN weights exactly: same greedy tokens."""
    gguf, _ = write_tiny_gguf("llama", tmp_path / "tiny.gguf", lambda name: "Q8_0")
    for model in (str(gguf), str(make_tiny_model("llama", tmp_path / "dense"))):
        llm = LLM(model, enable_sleep_mode=True, dtype="float32", kv_cache_gib=0.01, cache_dir=str(tmp_path))
        before = _greedy(llm)
        sleeping = llm.engine.sleeping
        assert sleeping is not None
        (runner,) = sleeping.runners
        packed = [path for path, slot in weight_slots(runner.weights.model).items() if slot.tensor.is_mkldnn]
        runner.weights.release(offload=True)
        assert resident_weight_bytes(runner.weights.model) == 0
        runner.weights.restore()
        assert _greedy(llm) == before, model
        after = [path for path, slot in weight_slots(runner.weights.model).items() if slot.tensor.is_mkldnn]
        assert after == packed


def test_engine_refuses_what_it_cannot_do(tiny_model_path: Any) -> None:
    """Sleep mode off, a bad level or tag, requests in flight, a request while asleep: each refused, naming it."""
    plain = LLMEngine.from_config(
        EngineConfig.from_flat(model=str(tiny_model_path("llama")), num_kv_blocks=64)
    )
    with pytest.raises(SleepModeError, match="--enable-sleep-mode") as off:
        plain.sleep(1)
    assert off.value.param == "model"
    llm = LLM(str(tiny_model_path("llama")), enable_sleep_mode=True, num_kv_blocks=64)
    engine = llm.engine
    with pytest.raises(SleepModeError, match="level") as bad_level:
        engine.sleep(3)
    assert bad_level.value.param == "level"
    with pytest.raises(SleepModeError, match="tags") as bad_tag:
        engine.wake_up(["weights", "gpu"])
    assert bad_tag.value.param == "tags"
    engine.add_request("busy", [5, 6, 7], GREEDY)
    with pytest.raises(SleepModeError, match="unfinished"):
        engine.sleep(1)
    while engine.has_unfinished_requests():
        engine.step()
    engine.sleep(2)
    with pytest.raises(EngineSleepingError):
        engine.add_request("late", [5, 6, 7], GREEDY)
    engine.wake_up(["weights"])  # a partial wake: the KV pool still sleeps
    assert _asleep(engine)
    engine.wake_up(["kv_cache"])
    assert not _asleep(engine)
    engine.add_request("late", [5, 6, 7], GREEDY)


# ----------------------------------------------------------------------------------------- flags and routes


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--sleep-idle-seconds", "-1"], "--sleep-idle-seconds"),
        (["--sleep-idle-seconds", "0"], "--sleep-idle-seconds"),
        (["--wake-on-request"], "--enable-sleep-mode"),
    ],
)
def test_bad_flags_exit_2_naming_them(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Negative or zero idle seconds, --wake-on-request without sleep mode: exit 2 before any model loads,
    naming the flag."""
    assert main(["serve", "/nonexistent-model", *flags]) == 2
    assert named in capsys.readouterr().err


def test_sleep_routes_are_404_without_sleep_mode() -> None:
    """Without --enable-sleep-mode the three routes answer 404 naming the flag; requests are served as usual."""
    with serve_in_thread(FakeEngine()) as running:
        for method, path in [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")]:
            response = httpx.request(method, running.base_url + path)
            assert response.status_code == 404, path
            assert "--enable-sleep-mode" in response.json()["error"]["message"]
        assert httpx.get(f"{running.base_url}/health").json() == {"status": "ok"}


# ------------------------------------------------------------------------------------------- a live server


def _rss_mb(pid: int) -> float:
    """VmRSS of process `pid` in MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a wide KV (WIDE_KV)."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("wide-llama"), **WIDE_KV)


class Sleepy:
    """A live server with sleep mode and the RSS it had before any request."""

    def __init__(self, server: LiveServer) -> None:
        self.server = server
        self.url = server.base_url
        self.rss_before_traffic = _rss_mb(server.process.pid)

    def complete(self, prompt: str | list[int] | list[list[int]], **fields: Any) -> httpx.Response:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **fields}
        return httpx.post(f"{self.url}/v1/completions", json=body, timeout=120)

    def post(self, path: str, **params: Any) -> httpx.Response:
        return httpx.post(self.url + path, params=params, timeout=120)

    def is_sleeping(self) -> bool:
        state = httpx.get(f"{self.url}/is_sleeping").json()
        assert isinstance(state, dict) and isinstance(state["is_sleeping"], bool)
        return state["is_sleeping"]


@pytest.fixture(scope="module")
def sleepy(wide_model: Path) -> Iterator[Sleepy]:
    """`pagoda serve --enable-sleep-mode` (in-process engine), without --wake-on-request. oneDNN's primitive
    caches are off (as in the soak test) so that their filling does not blur the RSS measurement."""
    env = {**os.environ, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0", "LRU_CACHE_CAPACITY": "1"}
    flags = [
        "--enable-sleep-mode",
        "--kv-cache-gib",
        str(KV_GIB),
        "--dtype",
        "float32",
        "--max-num-seqs",
        "64",
    ]
    with LiveServer(wide_model, flags, env=env) as server:
        yield Sleepy(server)


def _prefix_hits(url: str) -> float:
    """The prefix cache's hit counter (tokens) of /metrics."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("pagoda:prefix_cache_hits_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no pagoda:prefix_cache_hits_total in /metrics")


@pytest.mark.parametrize("level", [1, 2])
def test_live_sleep_and_wake_keep_greedy_tokens_and_serve_no_stale_prefix(sleepy: Sleepy, level: int) -> None:
    """Before the sleep a repeated prompt hits the prefix cache; after the wake the same prompt gets the same
    greedy tokens with no cached token and the hit counter does not move."""
    first = sleepy.complete(PREFIX_PROMPT).json()
    second = sleepy.complete(PREFIX_PROMPT).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == CACHEABLE_TOKENS  # the cache works
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    response = sleepy.post("/sleep", level=level)
    assert response.status_code == 200 and response.content == b""
    assert sleepy.is_sleeping()
    assert sleepy.post("/wake_up").status_code == 200
    assert not sleepy.is_sleeping()
    hits = _prefix_hits(sleepy.url)
    after = sleepy.complete(PREFIX_PROMPT).json()
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert _prefix_hits(sleepy.url) == hits
    assert after["choices"][0]["text"] == first["choices"][0]["text"]
    again = sleepy.complete(PREFIX_PROMPT).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == CACHEABLE_TOKENS


def test_live_requests_while_asleep_get_503_with_retry_after(sleepy: Sleepy) -> None:
    """Asleep: completions and chat get a 503 with Retry-After; /health says 200 "sleeping"; /tokenize still
    answers (the tokenizer is the front end's). A partial wake (tags=weights) keeps it asleep."""
    assert sleepy.post("/sleep").status_code == 200  # level 1 by default
    assert sleepy.post("/sleep", level=2).status_code == 200  # asleep already: nothing to do
    try:
        refused = sleepy.complete("Hello")
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert "--wake-on-request" in refused.json()["error"]["message"]
        chat = httpx.post(
            f"{sleepy.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert chat.status_code == 503
        health = httpx.get(f"{sleepy.url}/health")
        assert health.status_code == 200 and health.json() == {"status": "sleeping"}
        assert httpx.post(f"{sleepy.url}/tokenize", json={"prompt": "Hello"}).status_code == 200
        assert sleepy.post("/wake_up", tags="weights").status_code == 200
        assert sleepy.is_sleeping()
        assert sleepy.complete("Hello").status_code == 503
    finally:
        assert sleepy.post("/wake_up", tags="kv_cache").status_code == 200
    assert not sleepy.is_sleeping()
    assert httpx.get(f"{sleepy.url}/health").json() == {"status": "ok"}
    assert sleepy.complete("Hello").status_code == 200


def test_live_bad_sleep_parameters_are_400s_naming_them(sleepy: Sleepy) -> None:
    """A bad level, an unknown tag or query parameter: a 400 whose param names it; the server stays awake."""
    for path, params, param in [
        ("/sleep", {"level": "3"}, "level"),
        ("/sleep", {"level": "one"}, "level"),
        ("/wake_up", {"tags": "gpu"}, "tags"),
        ("/sleep", {"mode": "abort"}, "mode"),
    ]:
        response = sleepy.post(path, **params)
        assert response.status_code == 400, (path, params)
        assert response.json()["error"]["param"] == param
    assert not sleepy.is_sleeping()


def test_live_sleep_lets_requests_in_flight_finish(sleepy: Sleepy) -> None:
    """A /sleep sent while a request streams returns once that request finished normally (it is not aborted):
    the sleep happens on the engine thread between steps, once the engine is idle."""
    done: dict[str, Any] = {}

    def stream() -> None:
        body = {
            "prompt": "Once upon",
            "max_tokens": 160,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{sleepy.url}/v1/completions", json=body, timeout=120) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: {")]
        done["finish"] = [line for line in lines if '"finish_reason":"length"' in line.replace(" ", "")]
        done["at"] = time.monotonic()

    thread = threading.Thread(target=stream)
    thread.start()
    time.sleep(0.3)  # the stream is running
    assert sleepy.post("/sleep").status_code == 200
    slept_at = time.monotonic()
    thread.join(60)
    try:
        assert done["finish"], "the request in flight did not finish normally"
        assert done["at"] <= slept_at
    finally:
        sleepy.post("/wake_up")


def test_live_rss_falls_by_what_the_kv_pool_made_resident(sleepy: Sleepy) -> None:
    """Traffic makes most of the (untouched at start) KV pool resident; sleeping hands at least 80% of that RSS
    growth back to the system.

    Arithmetic: 2 requests x 64 distinct prompts x (240 + 1) tokens write 30,848 tokens x 8 KiB = 241 MiB of the
    256 MiB pool (distinct prompts: no block shared; the freed blocks keep their hashes and go to the back of the
    free queue, so every new block is a fresh one); the growth must show at least half of the pool (a block-level
    tail per request is at most 15 tokens x 128 requests = 15 MiB), and the fall at least 80% of the growth (the
    issue's bound; the weights, 1.7 MiB, are freed too).
    """
    pid = sleepy.server.process.pid
    rng = random.Random(42)
    for _ in range(2):
        prompts = [[rng.randrange(5, 380) for _ in range(240)] for _ in range(64)]
        assert sleepy.complete(prompts, max_tokens=1).status_code == 200
    after_traffic = _rss_mb(pid)
    growth = after_traffic - sleepy.rss_before_traffic
    assert growth >= 0.5 * POOL_BYTES / MB, f"the traffic made only {growth:.1f} MiB resident"
    assert sleepy.post("/sleep").status_code == 200
    try:
        asleep = _rss_mb(pid)
        fall = after_traffic - asleep
        print(
            f"RSS before traffic {sleepy.rss_before_traffic:.1f} MiB, after {after_traffic:.1f} MiB "
            f"(+{growth:.1f}), asleep {asleep:.1f} MiB (-{fall:.1f}, {100 * fall / growth:.0f}% of the growth)"
        )
        assert fall >= 0.8 * growth
    finally:
        assert sleepy.post("/wake_up").status_code == 200
    assert _rss_mb(pid) < after_traffic - 0.8 * growth  # the woken pool is untouched again
    assert sleepy.complete("Hello").status_code == 200


# ------------------------------------------------- engine cores, --sleep-idle-seconds and --wake-on-request

IDLE_S = 1.0


@pytest.fixture(scope="module")
def dozy(wide_model: Path) -> Iterator[Sleepy]:
    """Two data-parallel engine cores that sleep after IDLE_S idle seconds and wake for the next request
    (--sleep-idle-seconds alone implies --enable-sleep-mode and --wake-on-request, as llama.cpp's flag)."""
    flags = ["--data-parallel-size", "2", "--sleep-idle-seconds", str(IDLE_S), "--kv-cache-gib", "0.05"]
    flags += ["--dtype", "float32", "--max-num-seqs", "16"]
    with LiveServer(wide_model, flags, ready_timeout=300) as server:
        yield Sleepy(server)


def _wait_asleep(sleepy: Sleepy, timeout: float = 60.0) -> float:
    """Seconds until /is_sleeping says true (AssertionError after `timeout`)."""
    start = time.monotonic()
    while not sleepy.is_sleeping():
        assert time.monotonic() - start < timeout, "the idle server did not fall asleep"
        time.sleep(0.1)
    return time.monotonic() - start


def test_cores_sleep_when_idle_and_wake_for_a_request(dozy: Sleepy) -> None:
    """Idle for IDLE_S the cores sleep; a request then wakes them and gets the greedy tokens it got before, with
    no prefix block cached before the sleep (every replica's pool was reset, and the router forgot it)."""
    first = dozy.complete(PREFIX_PROMPT).json()
    cached = dozy.complete(PREFIX_PROMPT).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == CACHEABLE_TOKENS
    _wait_asleep(dozy)
    woken = dozy.complete(PREFIX_PROMPT)
    assert woken.status_code == 200
    assert woken.json()["choices"][0]["text"] == first["choices"][0]["text"]
    assert woken.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert httpx.get(f"{dozy.url}/health").json()["replicas_alive"] == 2


def test_cores_sleep_at_level_2_and_wake_for_concurrent_requests(dozy: Sleepy) -> None:
    """An explicit level-2 sleep of both cores (weights read back from the checkpoint at wake); then several
    requests at once wake them (one wake, the others wait for it) and all get the same greedy tokens."""
    reference = dozy.complete("Tokens, blocks, tables").json()["choices"][0]["text"]
    assert dozy.post("/sleep", level=2).status_code == 200
    assert dozy.is_sleeping()

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"prompt": "Tokens, blocks, tables", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(
                *(client.post(f"{dozy.url}/v1/completions", json=body) for _ in range(4))
            )

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * 4
    assert {r.json()["choices"][0]["text"] for r in responses} == {reference}
