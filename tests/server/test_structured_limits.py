"""Structured-outputs bounds: the compiled-grammar cache stays within its limit, constraint strings are capped
(400 naming the field), a constraint that compiles too slowly is a 400 while the server serves on, and a row
whose mask fill is slow aborts alone instead of stalling the step. Hostile case first, then a good one."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
import xgrammar as xgr
from api_cases import MAX_MODEL_LEN, MODEL
from api_fake_engine import FakeEngine, RunningServer, make_char_tokenizer, serve_in_thread
from pagoda.server.config import AppSettings
from pagoda.server.structured import GrammarBitmask, StructuredOutputManager, StructuredOutputsParams
from test_structured_bitmask import EOS, VOCAB, compiled

MAX_CHARS = 2000
COMPILE_TIMEOUT = 1.0
SLOW_REGEX = "(slow)+"  # the test's compiler holds this one until released


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    """A fake-engine server with a small constraint cap and a short compile deadline."""
    settings = AppSettings(max_grammar_chars=MAX_CHARS, grammar_compile_timeout=COMPILE_TIMEOUT)
    with serve_in_thread(FakeEngine(max_model_len=MAX_MODEL_LEN), settings=settings) as running:
        yield running


def complete(server: RunningServer, **extra: Any) -> httpx.Response:
    """POST a short completion with `extra` fields."""
    body = {"model": MODEL, "prompt": "ok", "max_tokens": 2, **extra}
    return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)


def assert_good_constrained_request(server: RunningServer) -> None:
    """A short constraint still compiles and is served."""
    response = complete(server, structured_outputs={"regex": "[a-z]+"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"structured_outputs": {"regex": "a" * (MAX_CHARS + 1)}}, "structured_outputs.regex"),
        (
            {"structured_outputs": {"grammar": 'root ::= "' + "a" * MAX_CHARS + '"'}},
            "structured_outputs.grammar",
        ),
        ({"guided_json": {"type": "object", "description": "x" * MAX_CHARS}}, "guided_json"),
        ({"guided_choice": ["y" * 100] * 30}, "guided_choice"),
    ],
    ids=["regex", "grammar", "json-schema", "choice"],
)
def test_a_constraint_over_the_cap_is_a_400(server: RunningServer, extra: dict[str, Any], param: str) -> None:
    """A regex, grammar, schema or choice list longer than --max-grammar-chars: 400 naming the field."""
    response = complete(server, **extra)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "--max-grammar-chars" in error["message"]
    assert_good_constrained_request(server)


def test_a_slow_compile_is_a_400_and_the_server_serves_on(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A constraint whose compile outlasts --grammar-compile-timeout: 400 naming the field; /health and other
    constrained requests are served meanwhile; the held compile is dropped when it ends."""
    release = threading.Event()
    original = StructuredOutputManager._compile

    def held_compile(self: StructuredOutputManager, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        if params.regex == SLOW_REGEX:
            release.wait(timeout=60)
        return original(self, params)

    monkeypatch.setattr(StructuredOutputManager, "_compile", held_compile)
    try:
        response = complete(server, structured_outputs={"regex": SLOW_REGEX})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "structured_outputs.regex"
        assert "--grammar-compile-timeout" in error["message"]
        assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
        assert_good_constrained_request(server)
    finally:
        release.set()


def test_the_compiled_grammar_cache_stays_within_its_limit() -> None:
    """Many distinct schemas: the cache holds at most its limit; unbounded, the same schemas hold more."""
    tokenizer = make_char_tokenizer()
    vocab_size = len(tokenizer)
    schemas = [
        {
            "type": "object",
            "properties": {f"k{i}": {"type": "string", "maxLength": 5 + i}},
            "required": [f"k{i}"],
        }
        for i in range(40)
    ]
    limit = 64 * 1024
    sizes = {}
    for name, bound in (("bounded", limit), ("unbounded", -1)):
        manager = StructuredOutputManager(tokenizer, vocab_size, [tokenizer.eos_token_id], bound)
        try:
            for schema in schemas:
                manager.compile(StructuredOutputsParams(json=json.dumps(schema))).result(timeout=60)
            sizes[name] = manager.cache_size_bytes
        finally:
            manager.shutdown()
    assert 0 < sizes["bounded"] <= limit
    assert sizes["unbounded"] > limit


class _SlowMatcher:
    """A matcher whose fill blocks until released: a grammar stuck in its mask fill."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def is_terminated(self) -> bool:
        """Never finished."""
        return False

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:  # [rows, ceil(vocab / 32)]
        """Block (bounded, so a broken test cannot hang the run), then allow nothing."""
        self.release.wait(timeout=60)
        bitmask[row].zero_()
        return True


def test_a_slow_row_fill_aborts_its_row_alone() -> None:
    """With one row's fill stuck, `apply` returns after --grammar-fill-timeout naming that row only; the other
    rows are masked as usual, and the next step (with the stuck fill still running) is served normally."""
    slow = _SlowMatcher()
    good = xgr.GrammarMatcher(compiled())
    bitmask = GrammarBitmask(len(VOCAB), [EOS], fill_timeout=2.0)
    rows: list[Any] = [good, slow, None]
    try:
        logits = torch.zeros(3, len(VOCAB))
        pending = bitmask.start_fill(rows)
        assert bitmask.apply(logits, pending) == (1,)
        allowed = {VOCAB[t] for t in torch.nonzero(logits[0] == 0).flatten().tolist()}
        assert allowed == {"{"}  # the schema's first character
        assert torch.equal(logits[2], torch.zeros(len(VOCAB)))  # unconstrained: untouched
        assert good.accept_token(VOCAB.index("{"))
        logits = torch.zeros(2, len(VOCAB))
        assert bitmask.apply(logits, bitmask.start_fill([good, None])) == ()
        allowed = {VOCAB[t] for t in torch.nonzero(logits[0] == 0).flatten().tolist()}
        assert '"' in allowed and "{" not in allowed
    finally:
        slow.release.set()
