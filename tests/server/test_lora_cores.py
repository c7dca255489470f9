"""Runtime LoRA updating with engine-core processes: a load or unload reaches every data-parallel core (and a
core that restarts loads the runtime adapters again); over HTTP, `POST /v1/load_lora_adapter` / `unload` with
`--data-parallel-size 2`, in-flight requests finishing on the adapter they started with."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from pagoda.server import testing
from pagoda.server.config import EngineConfig
from pagoda.server.core import CoreClient
from pagoda.server.core.lora_calls import LoRACalls
from pagoda.server.core.lora_frames import LoRADone
from pagoda.server.llm import LLM
from pagoda.server.lora import LoRAError, LoRARequest
from pagoda.server.procs import ProcessLauncher
from pagoda.server.routing import build_router
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import make_tiny_model
from pagoda.server.testing.tiny_lora import make_tiny_lora

pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-base"
KEY = "sk-lora-cores"
PROMPT = [5, 17, 42, 9, 33, 71, 8, 120]
READY_S = 300  # engine cores start a fresh interpreter each: slow on a busy 2-core machine


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny base model and two adapters (a from the start, b loaded at run time)."""
    root = tmp_path_factory.mktemp("lora-cores")
    base = make_tiny_model("llama", root / "base", max_position_embeddings=256)
    return {
        "base": base,
        "a": make_tiny_lora(base, root / "a", rank=8, seed=1),
        "b": make_tiny_lora(base, root / "b", rank=4, seed=2),
    }


def _wait(client: CoreClient, future: Future[tuple[int, ...]]) -> tuple[int, ...]:
    """Drive the client (as the engine thread does) until `future` is done; its result."""
    deadline = time.monotonic() + 120
    while not future.done():
        assert time.monotonic() < deadline, "the cores did not answer"
        client.step()
    return future.result()


@pytest.mark.timeout(900)
def test_loads_and_unloads_reach_every_core(folders: dict[str, Path]) -> None:
    """Two cores: a load answers once both serve the adapter; a bad folder is refused by the cores (LoRAError
    naming lora_path); a killed core, restarted, loads the runtime adapter again (its unload succeeds)."""
    config = EngineConfig.from_flat(
        model=str(folders["base"]),
        num_kv_blocks=64,
        dtype="float32",
        max_model_len=256,
        enable_lora=True,
        max_loras=2,
        lora_modules=(),
    )
    client = CoreClient(config, ProcessLauncher(2, logging.INFO), build_router("round_robin", 2, 16), 2)
    try:
        assert _wait(client, client.load_lora(LoRARequest("b", 1, str(folders["b"])))) == (0, 1)
        with pytest.raises(LoRAError) as info:
            _wait(client, client.load_lora(LoRARequest("bad", 2, str(folders["base"] / "missing"))))
        assert info.value.param == "lora_path" and "not a readable PEFT adapter folder" in str(info.value)
        handle = client.replicas[1].handle
        assert handle is not None
        handle.kill()
        deadline = time.monotonic() + READY_S
        while not (client.replicas[1].ready and client.replicas[1].restarts == 1):
            assert time.monotonic() < deadline, "core 1 was not restarted"
            client.step()
        assert _wait(client, client.unload_lora("b")) == (0, 1)  # core 1 had b again
        with pytest.raises(LoRAError) as info:
            _wait(client, client.unload_lora("b"))
        assert info.value.param == "lora_name"
    finally:
        client.close()


@pytest.fixture(scope="module")
def live(folders: dict[str, Path]) -> Iterator[testing.LiveServer]:
    """Two engine-core replicas, round robin (so both serve), adapter a from the start, runtime updating on."""
    flags = [
        "--kv-cache-gib", "0.05", "--dtype", "float32", "--admin-api-key", KEY, "--data-parallel-size", "2",
        "--routing-policy", "round_robin", "--enable-lora", "--lora-modules", f"a={folders['a']}",
        "--max-loras", "2", "--allow-runtime-lora-updating",
    ]  # fmt: skip
    server = testing.LiveServer(
        folders["base"], flags, served_model_name=MODEL, ready_timeout=READY_S, cwd=ROOT
    )
    try:
        yield server
    finally:
        assert server.stop() == 0


def _client(live: testing.LiveServer) -> httpx.Client:
    return httpx.Client(base_url=live.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def _complete(live: testing.LiveServer, model: str, max_tokens: int = 8) -> httpx.Response:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    with _client(live) as c:
        return c.post("/v1/completions", json=body)


def _offline_text(folders: dict[str, Path], max_tokens: int) -> str:
    """Adapter b's greedy text in the offline engine (whose tokens equal PEFT's: test_lora_engine.py)."""
    llm = LLM(str(folders["base"]), dtype="float32", enable_lora=True, max_loras=2, num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate([PROMPT], params, use_tqdm=False, lora_request=LoRARequest("b", 7, str(folders["b"])))
    return out[0].outputs[0].text


@pytest.mark.timeout(900)
def test_runtime_load_and_unload_with_dp2_cores(live: testing.LiveServer, folders: dict[str, Path]) -> None:
    """Load b over HTTP with two cores; streams on b over both cores, unloaded meanwhile, finish on b with its
    tokens; new requests for b are a 404; a bad folder is a 400 naming lora_path; b loads again."""
    max_tokens = 96
    want = _offline_text(folders, max_tokens)
    with _client(live) as c:
        loaded = c.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(folders["b"])})
        assert loaded.status_code == 200, loaded.text
        bad = c.post(
            "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(folders["base"] / "no")}
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path", bad.text
    first_chunk: list[bool] = []

    def stream_on_b() -> str:
        body: dict[str, Any] = {
            "model": "b",
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        text = ""
        with _client(live) as c, c.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    assert chunk["model"] == "b"
                    text += "".join(choice["text"] for choice in chunk["choices"])
                    first_chunk.append(True)
        return text

    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(stream_on_b) for _ in range(4)]  # round robin: two on each core
        while len(first_chunk) < 4 and not any(s.done() for s in streams):
            time.sleep(0.002)
        in_flight = not any(s.done() for s in streams)
        with _client(live) as c:
            removed = c.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
        texts = [s.result(timeout=300) for s in streams]
    assert removed.status_code == 200, removed.text
    assert in_flight, "the streams finished before the unload"
    assert texts == [want] * 4
    assert _complete(live, "b").status_code == 404
    assert _complete(live, "a").status_code == 200
    with _client(live) as c:
        again = c.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(folders["b"])})
        assert again.status_code == 200, again.text
    for _ in range(2):  # one on each core
        got = _complete(live, "b", max_tokens)
        assert got.status_code == 200 and got.json()["choices"][0]["text"] == want


def test_a_load_one_core_refuses_is_rolled_back_on_the_others() -> None:
    """Core 1 refuses what core 0 took: the call raises core 1's LoRAError, core 0 is sent the unload, and a new
    core is not sent the adapter; a core that dies before answering is not waited for."""
    calls = LoRACalls()
    request = LoRARequest("b", 3, "/adapters/b")
    frame, future = calls.load(request, [0, 1])
    assert [load.request for load in calls.replay()] == [request]
    assert calls.answer(0, LoRADone(frame.call_id)) == [] and not future.done()
    rollback = calls.answer(1, LoRADone(frame.call_id, "rank 32 is above --max-lora-rank 16", "lora_path"))
    assert [(index, unload.lora_name) for index, unload in rollback] == [(0, "b")]
    with pytest.raises(LoRAError, match="max-lora-rank") as info:
        future.result(timeout=0)
    assert info.value.param == "lora_path" and calls.replay() == [] and not calls.pending

    frame, future = calls.load(request, [0, 1])
    calls.answer(1, LoRADone(frame.call_id))
    assert calls.answer(1, LoRADone(frame.call_id)) == []  # a repeated answer is ignored
    assert calls.replica_lost(0) == [] and future.result(timeout=0) == (1,)
    _, unloaded = calls.unload("b", [])
    assert unloaded.result(timeout=0) == () and calls.replay() == []
