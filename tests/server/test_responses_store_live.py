"""Stored /v1/responses through a live server with two API keys (issue 43): each key has its own quota (a count and
bytes), a full quota of responses still running refuses the new one (429 naming `background` or `store`) instead
of cancelling one, the echoed fields are bounded (400 naming the field), and `model` naming a LoRA adapter runs
the adapter."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pagoda.server import testing
from pagoda.server.api.responses_protocol import MAX_TOOLS_BYTES
from pagoda.server.cli import main
from pagoda.server.cli_args import build_parser, serve_config
from pagoda.server.testing import make_tiny_model
from pagoda.server.testing.tiny_lora import make_tiny_lora

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-base"
KEYS = ("sk-store-a", "sk-store-b")
FLAGS = ("--kv-cache-gib", "0.05", "--dtype", "float32", "--api-key", KEYS[0], "--api-key", KEYS[1])
MAX_STORED = 3
MAX_BYTES = (
    16_000  # the second server's per-key bytes: one response with a 10,000-character `user` fits, two not
)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("store") / "llama", max_position_embeddings=4096)


def _serve(model: Path, *extra: str) -> Iterator[testing.LiveServer]:
    server = testing.LiveServer(model, [*FLAGS, *extra], served_model_name=MODEL, ready_timeout=180, cwd=ROOT)
    try:
        yield server
    finally:
        assert server.stop() == 0


@pytest.fixture(scope="module")
def counted(base: Path) -> Iterator[testing.LiveServer]:
    """Three stored responses per key."""
    yield from _serve(base, "--max-model-len", "4096", "--max-stored-responses", str(MAX_STORED))


@pytest.fixture(scope="module")
def sized(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[testing.LiveServer]:
    """MAX_BYTES per key, and a LoRA adapter `ad`."""
    adapter = make_tiny_lora(base, tmp_path_factory.mktemp("store-lora") / "ad", rank=8, seed=1)
    yield from _serve(
        base,
        "--max-model-len", "512", "--max-stored-response-bytes", str(MAX_BYTES),
        "--enable-lora", "--lora-modules", f"ad={adapter}", "--max-lora-rank", "8",
    )  # fmt: skip


def _client(live: testing.LiveServer, key: str) -> httpx.Client:
    return httpx.Client(base_url=live.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def _create(http: httpx.Client, **fields: Any) -> httpx.Response:
    body: dict[str, Any] = {"model": MODEL, "input": "hello", "max_output_tokens": 4, **fields}
    return http.post("/v1/responses", json=body)


def _status(http: httpx.Client, response_id: str) -> tuple[int, str | None]:
    got = http.get(f"/v1/responses/{response_id}")
    return got.status_code, got.json().get("status") if got.status_code == 200 else None


def test_each_key_has_its_own_quota_and_running_ones_are_never_cancelled(counted: testing.LiveServer) -> None:
    """Key a's three long background responses fill its quota: a fourth (background or stored) is a 429 naming
    the field, unstored still works; key b's burst of stored responses neither drops nor cancels a's; once a's
    are cancelled, a stores again, its own least recently used going first."""
    with _client(counted, KEYS[0]) as a, _client(counted, KEYS[1]) as b:
        long = {"background": True, "max_output_tokens": 3500, "ignore_eos": True}
        running = [_create(a, **long).json()["id"] for _ in range(MAX_STORED)]
        for fields, param in ((long, "background"), ({}, "store")):
            refused = _create(a, **fields)
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["param"] == param
            assert refused.headers["retry-after"]
        assert _create(a, store=False).status_code == 200
        burst = [_create(b).json()["id"] for _ in range(MAX_STORED + 2)]
        for response_id in running:  # still there, and not cancelled to make room for b's
            code, status = _status(a, response_id)
            assert code == 200 and status in ("queued", "in_progress", "completed"), (code, status)
        assert [_status(b, i)[0] for i in burst] == [404, 404] + [200] * MAX_STORED  # b's own LRU
        for response_id in running:
            assert a.post(f"/v1/responses/{response_id}/cancel").status_code in (200, 400)
        stored = [_create(a).json()["id"] for _ in range(MAX_STORED)]
        assert all(_status(a, i)[0] == 200 for i in stored)
        assert sum(_status(a, i)[0] == 404 for i in running) == MAX_STORED
        assert _status(b, burst[-1])[0] == 200


def test_stored_bytes_are_bounded_per_key(sized: testing.LiveServer) -> None:
    """Beyond --max-stored-response-bytes a key's least recently used response goes (below the count bound);
    another key's stay; a response that could never fit is a 400 naming store."""
    with _client(sized, KEYS[0]) as a, _client(sized, KEYS[1]) as b:
        theirs = _create(b, user="b" * 10_000).json()["id"]
        first = _create(a, user="u" * 10_000).json()["id"]
        assert _status(a, first)[0] == 200
        second = _create(a, user="v" * 10_000).json()["id"]
        assert _status(a, first)[0] == 404
        assert _status(a, second)[0] == 200
        assert _status(b, theirs)[0] == 200
        metadata = {f"{i:064d}": "m" * 512 for i in range(16)}
        too_big = _create(a, user="w" * 10_000, metadata=metadata)
        assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "store", too_big.text
        assert _create(a, user="w" * 10_000, metadata=metadata, store=False).status_code == 200


BAD_FIELDS: list[tuple[dict[str, Any], str]] = [
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata"),
    ({"user": "u" * 10_001}, "user"),
    ({"safety_identifier": "s" * 10_001}, "safety_identifier"),
    ({"prompt_cache_key": "p" * 1025}, "prompt_cache_key"),
    (
        {
            "tools": [{"type": "function", "name": "f", "description": "d" * MAX_TOOLS_BYTES}],
            "tool_choice": "none",
        },
        "tools",
    ),
]


@pytest.mark.parametrize(("fields", "param"), BAD_FIELDS)
def test_echoed_fields_are_bounded(sized: testing.LiveServer, fields: dict[str, Any], param: str) -> None:
    """Each echoed field beyond its bound is a 400 naming it, and the server goes on serving."""
    with _client(sized, KEYS[0]) as a:
        refused = _create(a, **fields, store=False)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == param
        assert _create(a, store=False).status_code == 200


def test_fields_at_their_bounds_are_accepted_and_echoed(sized: testing.LiveServer) -> None:
    """OpenAI's bounds themselves pass: 16 metadata keys of 64 characters with 512-character values."""
    metadata = {f"{i:064d}": "m" * 512 for i in range(16)}
    with _client(sized, KEYS[1]) as b:
        done = _create(b, metadata=metadata, safety_identifier="s" * 10_000, prompt_cache_key="p" * 1024)
        assert done.status_code == 200, done.text
        assert done.json()["metadata"] == metadata


def test_responses_run_the_adapter_named_in_model(sized: testing.LiveServer) -> None:
    """model: an adapter's name runs the adapter: the greedy output equals chat's under that name, and differs
    from the base model's."""
    greedy = {"temperature": 0.0, "ignore_eos": True}
    messages = [{"role": "user", "content": "hello"}]

    def chat(http: httpx.Client, model: str) -> str:
        body = {"model": model, "messages": messages, "max_tokens": 12, **greedy}
        answer = http.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        text: str = answer.json()["choices"][0]["message"]["content"]
        return text

    with _client(sized, KEYS[0]) as a:
        response = _create(a, model="ad", input=messages, max_output_tokens=12, store=False, **greedy).json()
        assert response["model"] == "ad"
        (item,) = [i for i in response["output"] if i["type"] == "message"]
        text = "".join(part["text"] for part in item["content"])
        assert text == chat(a, "ad")
        assert text != chat(a, MODEL)


def test_max_stored_response_bytes_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """The flag reaches AppSettings; a bound below 1 exits 2 naming it."""
    config = serve_config(build_parser().parse_args(["serve", "m", "--max-stored-response-bytes", "4096"]))
    assert config.app.max_stored_response_bytes == 4096
    assert main(["serve", "unused-model", "--max-stored-response-bytes", "0"]) == 2
    assert "max-stored-response-bytes" in capsys.readouterr().err
