"""LoRA over HTTP: a live `pagoda serve --enable-lora` with adapters named in `model`, listed by /v1/models, loaded
and unloaded at run time behind the API key (in-flight requests finish on their adapter), each bad input a 400
naming the field while the server keeps serving; and the LoRA flags (a bad one exits 2)."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import torch
from pagoda.server import testing
from pagoda.server.api.errors import APIError
from pagoda.server.api.protocol import CompletionRequest
from pagoda.server.api.serving_base import ServingContext
from pagoda.server.cli import build_parser, engine_config, main
from pagoda.server.config import LoRAConfig, LoRAModulePath, RequestLimits
from pagoda.server.engine.admission import AdmissionRules
from pagoda.server.llm import LLM
from pagoda.server.lora import LoRARequest
from pagoda.server.lora.served import ServedLoRAs
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import make_tiny_model
from pagoda.server.testing.tiny_lora import make_tiny_lora
from safetensors.torch import load_file, save_file

pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-base"
KEY = "sk-lora-test"
PROMPT = [5, 17, 42, 9, 33, 71, 8, 120]


class Adapters:
    """The tiny base model, good adapters and one broken adapter per refusal."""

    def __init__(self, root: Path) -> None:
        self.base = make_tiny_model("llama", root / "base", max_position_embeddings=256)
        self.a = make_tiny_lora(self.base, root / "a", rank=8, seed=1)
        self.b = make_tiny_lora(self.base, root / "b", rank=4, seed=2)
        self.high_rank = make_tiny_lora(self.base, root / "high", rank=32, seed=3)
        self.bad_targets = _rewrite(self.b, root / "targets", rename=("q_proj", "fc_in"))
        self.mixed_dtype = _rewrite(self.b, root / "dtype", half_a=True)


def _rewrite(src: Path, dst: Path, *, rename: tuple[str, str] | None = None, half_a: bool = False) -> Path:
    """A copy of adapter `src` with a module renamed (one the model lacks) or its A factors in float16."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "adapter_model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if rename is not None:
            key = key.replace(*rename)
        out[key] = value.half() if half_a and "lora_A" in key else value
    save_file(out, dst / "adapter_model.safetensors")
    if rename is not None:
        config = json.loads((dst / "adapter_config.json").read_text())
        config["target_modules"] = [rename[1] if t == rename[0] else t for t in config["target_modules"]]
        (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Adapters:
    """Built once for the module."""
    return Adapters(tmp_path_factory.mktemp("lora-api"))


@pytest.fixture(scope="module")
def live(adapters: Adapters) -> Iterator[testing.LiveServer]:
    """The server with adapter `a` from the start and runtime updating on, behind an API key."""
    flags = [
        "--kv-cache-gib", "0.05", "--dtype", "float32", "--admin-api-key", KEY,
        "--enable-lora", "--lora-modules", f"a={adapters.a}", "--max-loras", "2", "--max-lora-rank", "16",
        "--allow-runtime-lora-updating",
    ]  # fmt: skip
    server = testing.LiveServer(adapters.base, flags, served_model_name=MODEL, ready_timeout=180, cwd=ROOT)
    try:
        yield server
    finally:
        assert server.stop() == 0


def client(live: testing.LiveServer) -> httpx.Client:
    """An httpx client with the API key."""
    return httpx.Client(base_url=live.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def complete(live: testing.LiveServer, model: str, max_tokens: int = 8) -> httpx.Response:
    """A greedy completion of PROMPT under `model`."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    with client(live) as c:
        return c.post("/v1/completions", json=body)


class Offline:
    """The offline engine's texts (its token ids equal transformers + PEFT's: test_lora_engine.py), detokenized
    as the server does, as the reference the server must match."""

    def __init__(self, adapters: Adapters) -> None:
        self.llm = LLM(str(adapters.base), dtype="float32", enable_lora=True, max_loras=2, num_kv_blocks=64)
        self.next_id = 100

    def text(self, adapter: Path | None, max_tokens: int = 8) -> str:
        """Greedy text of PROMPT under `adapter` (None: the base model)."""
        lora = None
        if adapter is not None:
            lora = LoRARequest(adapter.name, self.next_id, str(adapter))
            self.next_id += 1
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        out = self.llm.generate([PROMPT], params, use_tqdm=False, lora_request=lora)
        return out[0].outputs[0].text


@pytest.fixture(scope="module")
def offline(adapters: Adapters) -> Offline:
    """Built once for the module."""
    return Offline(adapters)


def load(live: testing.LiveServer, name: str, path: Path | str) -> httpx.Response:
    """POST /v1/load_lora_adapter."""
    with client(live) as c:
        return c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


def unload(live: testing.LiveServer, name: str) -> httpx.Response:
    """POST /v1/unload_lora_adapter."""
    with client(live) as c:
        return c.post("/v1/unload_lora_adapter", json={"lora_name": name})


def models(live: testing.LiveServer) -> dict[str, str | None]:
    """GET /v1/models: id -> parent."""
    with client(live) as c:
        data = c.get("/v1/models").json()["data"]
    return {card["id"]: card.get("parent") for card in data}


def test_adapters_are_listed_and_served_by_model_name(
    live: testing.LiveServer, adapters: Adapters, offline: Offline
) -> None:
    """/v1/models lists `a` with its parent; `model: a` gives PEFT's tokens, the base model its own."""
    assert models(live) == {MODEL: None, "a": MODEL}
    got_a = complete(live, "a")
    assert got_a.status_code == 200, got_a.text
    assert got_a.json()["choices"][0]["text"] == offline.text(adapters.a)
    got_base = complete(live, MODEL)
    assert got_base.json()["choices"][0]["text"] == offline.text(None)
    assert got_base.json()["choices"][0]["text"] != got_a.json()["choices"][0]["text"]


def test_responses_name_the_adapter(live: testing.LiveServer) -> None:
    """A request for adapter `a` gets `"model": "a"` back (as vLLM does) from completions, chat, their streamed
    chunks and responses; a request for the base model gets the base model's name."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0.0}
    text = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0.0}
    with client(live) as c:
        for model in ("a", MODEL):
            got = {
                "completion": c.post("/v1/completions", json={**text, "model": model}).json()["model"],
                "chat": c.post("/v1/chat/completions", json={**chat, "model": model}).json()["model"],
                "response": c.post(
                    "/v1/responses", json={"model": model, "input": "hi", "max_output_tokens": 3}
                ).json()["model"],
            }
            for path, body in (("/v1/completions", text), ("/v1/chat/completions", chat)):
                with c.stream("POST", path, json={**body, "model": model, "stream": True}) as response:
                    chunks = [
                        json.loads(line[6:])
                        for line in response.iter_lines()
                        if line.startswith("data: ") and line != "data: [DONE]"
                    ]
                assert chunks and {chunk["model"] for chunk in chunks} == {model}, (path, chunks)
            assert got == dict.fromkeys(got, model), got


def test_the_endpoints_need_the_api_key(live: testing.LiveServer, adapters: Adapters) -> None:
    """Without the key, load and unload are 401s."""
    with httpx.Client(base_url=live.base_url, timeout=30) as c:
        response = c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(adapters.b)})
        assert response.status_code == 401
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 401
    assert "x" not in models(live)


@pytest.mark.parametrize(
    ("case", "param", "words"),
    [
        ("missing", "lora_path", "not a readable PEFT adapter folder"),
        ("rank", "lora_path", "--max-lora-rank"),
        ("targets", "lora_path", "fc_in"),
        ("dtype", "lora_path", "dtype"),
        ("taken", "lora_name", "already taken"),
        ("base-name", "lora_name", "already taken"),
        ("unknown-unload", "lora_name", "no LoRA adapter"),
        ("empty-name", "lora_name", ""),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    live: testing.LiveServer, adapters: Adapters, case: str, param: str, words: str
) -> None:
    """Each refusal is an OpenAI-shaped 400 naming the field, and the server keeps serving."""
    paths = {
        "missing": ("m", adapters.base / "no-such-adapter"),
        "rank": ("r", adapters.high_rank),
        "targets": ("t", adapters.bad_targets),
        "dtype": ("d", adapters.mixed_dtype),
        "taken": ("a", adapters.b),
        "base-name": (MODEL, adapters.b),
        "empty-name": ("", adapters.b),
    }
    response = unload(live, "nope") if case == "unknown-unload" else load(live, *paths[case])
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert set(models(live)) == {MODEL, "a"}
    assert complete(live, "a").status_code == 200


def test_an_unknown_model_name_is_refused(live: testing.LiveServer) -> None:
    """A completion naming neither the model nor an adapter is a 404 naming `model` (vLLM's status)."""
    response = complete(live, "not-an-adapter")
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "model"


def test_runtime_load_and_unload_under_load(
    live: testing.LiveServer, adapters: Adapters, offline: Offline
) -> None:
    """Load b; while requests stream on b, unload it: they finish on b (PEFT's tokens), new ones are refused."""
    assert load(live, "b", adapters.b).status_code == 200
    assert models(live)["b"] == MODEL
    max_tokens = 120
    want = offline.text(adapters.b, max_tokens)
    started: set[int] = set()  # the streams that have had a chunk: the engine runs them on b

    def stream_on_b(index: int) -> str:
        body = {
            "model": "b",
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        body["stream"] = True
        text = ""
        with client(live) as c, c.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    assert chunk["model"] == "b", chunk  # also the chunks after the unload
                    text += "".join(choice["text"] for choice in chunk["choices"])
                    started.add(index)
        return text

    with ThreadPoolExecutor(3) as pool:
        streams = [pool.submit(stream_on_b, i) for i in range(3)]
        # Unloaded once all three run: a request still in the front end then gets a 404 (the next test).
        while len(started) < 3 and not any(s.done() for s in streams):
            time.sleep(0.002)
        in_flight = not any(s.done() for s in streams)
        removed = unload(live, "b")
        texts = [s.result(timeout=300) for s in streams]
    assert removed.status_code == 200, removed.text
    assert in_flight, "the streams finished before the unload"
    assert texts == [want] * 3
    assert "b" not in models(live)
    assert complete(live, "b").status_code == 404
    assert complete(live, "a").status_code == 200
    # Loaded again (a fresh id), it serves the same tokens.
    assert load(live, "b", adapters.b).status_code == 200
    assert complete(live, "b", max_tokens).json()["choices"][0]["text"] == want


def test_an_adapter_unloaded_after_the_model_check_is_a_404_not_the_base_model() -> None:
    """A request checks its `model` on arrival and reads its adapter again (awaits later) when its sampling
    parameters are built: an unload in between is a 404 naming `model`, never a silent run on the base model."""
    loras = ServedLoRAs(LoRAConfig(enable_lora=True, lora_modules=(LoRAModulePath("b", "/adapters/b"),)))
    ctx = ServingContext(
        llm=cast(Any, None),  # neither is reached by the model check or the sampling parameters
        tokenizer=cast(Any, None),
        served_model_name=MODEL,
        rules=AdmissionRules(256, 512),
        chat_template=None,
        executor=cast(Any, None),
        limits=RequestLimits(),
        max_prompt_chars=Future(),
        loras=loras,
    )
    body = CompletionRequest(model="b", prompt=PROMPT, max_tokens=4)
    ctx.check_model(body.model)
    assert ctx.sampling_params(body, max_tokens=4, logprobs=None).lora_request == loras.get("b")
    assert (
        ctx.sampling_params(
            body.model_copy(update={"model": MODEL}), max_tokens=4, logprobs=None
        ).lora_request
        is None
    )
    loras.remove("b")
    with pytest.raises(APIError) as refused:
        ctx.sampling_params(body, max_tokens=4, logprobs=None)
    assert (refused.value.status, refused.value.param) == (404, "model")


def test_lora_flags_map_onto_the_config(adapters: Adapters) -> None:
    """vLLM's flags land in the LoRA section (and the scheduler's max_loras); JSON module specs too."""
    spec = json.dumps({"name": "j", "path": "/p/j", "base_model_name": "base"})
    args = build_parser().parse_args(
        ["serve", "m", "--enable-lora", "--lora-modules", "a=/p/a", spec, "--max-loras", "3",
         "--max-lora-rank", "32", "--max-cpu-loras", "5", "--allow-runtime-lora-updating"]
    )  # fmt: skip
    config = engine_config(args)
    lora = config.lora_config
    assert lora.enable_lora and lora.allow_runtime_lora_updating
    assert lora.lora_modules == (LoRAModulePath("a", "/p/a"), LoRAModulePath("j", "/p/j", "base"))
    assert (lora.max_lora_rank, lora.max_cpu_loras, config.scheduler_config.max_loras) == (32, 5, 3)


def test_runtime_updating_from_vllm_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """VLLM_ALLOW_RUNTIME_LORA_UPDATING=True turns runtime updating on without the flag."""
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert engine_config(
        build_parser().parse_args(["serve", "m", "--enable-lora"])
    ).lora_config.allow_runtime_lora_updating
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    assert not engine_config(
        build_parser().parse_args(["serve", "m"])
    ).lora_config.allow_runtime_lora_updating


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--enable-lora", "--lora-modules", "no-equals-sign"], "--lora-modules"),
        (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "--lora-modules"),
        (["--lora-modules", "a=/x"], "--enable-lora"),
        (["--enable-lora", "--max-lora-rank", "0"], "--max-lora-rank"),
        (["--enable-lora", "--max-loras", "0"], "--max-loras"),
        (["--enable-lora", "--max-cpu-loras", "0"], "--max-cpu-loras"),
    ],
)
def test_bad_lora_flags_exit_2(flags: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A bad LoRA flag exits 2 naming it, before any model loads."""
    assert main(["serve", "unused-model", *flags]) == 2
    assert named in capsys.readouterr().err
