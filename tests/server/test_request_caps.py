"""Unbounded per-request work (issue 28, items 5 and 6): caps on per-request lists, each a 400 naming the field
with the server serving on; beam fan-out counted by its width; bad words tokenized at admission, and the
logits-processor masks built once per request."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest
import torch
from api_cases import MODEL
from api_fake_engine import FakeEngine, RunningServer, make_char_tokenizer, serve_in_thread
from pagoda.server.api import AppSettings
from pagoda.server.api.protocol import (
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS_KEYS,
    MAX_PROMPT_LOGPROB_ENTRIES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
)
from pagoda.server.config import RequestLimits
from pagoda.server.engine import requests as engine_requests
from pagoda.server.engine.requests import RequestState
from pagoda.server.multimodal import MultiModalInputs
from pagoda.server.sampling.logits_processors import LogitsEdits, apply_logits_processors, tokenize_bad_words
from pagoda.server.sampling_params import SamplingParams


class RecordingEngine(FakeEngine):
    """The fake engine, keeping the SamplingParams of every request it was given."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.params: list[SamplingParams] = []

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        arrival_time: float | None = None,
        multi_modal: MultiModalInputs | None = None,
    ) -> None:
        """Record, then queue as the fake does."""
        self.params.append(params)
        super().add_request(request_id, prompt_token_ids, params, prompt=prompt, arrival_time=arrival_time)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    """One server over the recording fake engine with a long context and small fan-out caps."""
    limits = RequestLimits(max_prompts_per_request=8, max_sequences_per_request=8)
    engine = RecordingEngine(max_model_len=20_000)
    with serve_in_thread(engine, settings=AppSettings(limits=limits), max_waiting_requests=8) as running:
        yield running


def post(server: RunningServer, **fields: Any) -> httpx.Response:
    """A completion request of `fields` (a one-token "hi" by default)."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, **fields}
    return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)


def assert_400(response: httpx.Response, param: str) -> str:
    """An OpenAI-shaped 400 naming `param`; returns its message."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == 400, error
    return str(error["message"])


def assert_ok(response: httpx.Response) -> None:
    """A 200 with choices."""
    assert response.status_code == 200, response.text
    assert response.json()["choices"]


def test_logit_bias_counts_keys_as_sent(server: RunningServer) -> None:
    """301 keys are a 400 even when they name only 50 token ids ("5", "05", "005", ...): counted as sent, before
    merging. 300 such keys are served."""

    def keys(count: int) -> dict[str, float]:
        return {"0" * (i // 50) + str(i % 50): 1.0 for i in range(count)}

    assert len({int(k) for k in keys(MAX_LOGIT_BIAS_KEYS + 1)}) == 50
    assert_400(post(server, logit_bias=keys(MAX_LOGIT_BIAS_KEYS + 1)), "logit_bias")
    assert_ok(post(server, logit_bias=keys(MAX_LOGIT_BIAS_KEYS)))


def test_allowed_token_ids_at_most_the_vocabulary(server: RunningServer) -> None:
    """More ids than the vocabulary has (duplicates of valid ones) is a 400; the whole vocabulary is served."""
    vocab = server.engine.vocab_size
    assert_400(post(server, allowed_token_ids=[10] * (vocab + 1)), "allowed_token_ids")
    assert_ok(post(server, allowed_token_ids=list(range(vocab))))


def test_bad_words_count_and_length(server: RunningServer) -> None:
    """301 words, or one word of 257 characters, is a 400 naming bad_words; 300 words of 256 are served."""
    assert_400(post(server, bad_words=["ab"] * (MAX_BAD_WORDS + 1)), "bad_words")
    assert_400(post(server, bad_words=["a" * (MAX_BAD_WORD_CHARS + 1)]), "bad_words")
    assert_ok(post(server, bad_words=["a" * MAX_BAD_WORD_CHARS] * MAX_BAD_WORDS))


def test_stop_count_and_length(server: RunningServer) -> None:
    """17 stop strings, or one of 1,025 characters (alone or in a list), is a 400 naming stop; 16 of 1,024 are
    served."""
    assert_400(post(server, stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop")
    assert_400(post(server, stop="x" * (MAX_STOP_STRING_CHARS + 1)), "stop")
    assert_400(post(server, stop=["x", "y" * (MAX_STOP_STRING_CHARS + 1)]), "stop")
    assert_ok(post(server, stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS))


def test_prompt_logprobs_times_prompt_length(server: RunningServer) -> None:
    """prompt_logprobs 20 over a 12,500-token prompt (262,500 entries) is a 400 naming prompt_logprobs; so is
    echo + logprobs over it (naming logprobs); prompt_logprobs 1 over it is served."""
    long_prompt = "a" * 12_500
    assert 12_500 * 21 > MAX_PROMPT_LOGPROB_ENTRIES >= 12_501 * 2
    assert_400(post(server, prompt=long_prompt, prompt_logprobs=20), "prompt_logprobs")
    assert_400(post(server, prompt=long_prompt, echo=True, logprobs=20), "logprobs")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": long_prompt}], "max_tokens": 1}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json={**chat, "prompt_logprobs": 20})
    assert_400(response, "prompt_logprobs")
    assert_ok(post(server, prompt=long_prompt, prompt_logprobs=1))


def test_bad_words_are_tokenized_at_admission(server: RunningServer) -> None:
    """The engine receives the bad words' token sequences with the parameters: the engine thread tokenizes
    nothing."""
    words = ["ab", "c d"]
    assert_ok(post(server, bad_words=words))
    engine = server.engine
    assert isinstance(engine, RecordingEngine)
    params = engine.params[-1]
    assert params.bad_words == tuple(words)
    assert params.bad_words_token_ids == tokenize_bad_words(server.engine.tokenizer, words)


def test_beam_fan_out_counts_best_of(server: RunningServer) -> None:
    """Caps of 8 sequences: 3 prompts x best_of 4 beams (12 sequences, n = 1) is a 400 naming best_of, as is one
    prompt of width 16 against --max-waiting-requests 8 (never admissible); 2 prompts x 4 beams are served."""
    beam = {"use_beam_search": True, "temperature": 0.0, "n": 1, "best_of": 4}
    message = assert_400(post(server, prompt=["a", "b", "c"], **beam), "best_of")
    assert "--max-sequences-per-request" in message
    limits = RequestLimits(max_prompts_per_request=8, max_sequences_per_request=64)
    with serve_in_thread(FakeEngine(), settings=AppSettings(limits=limits), max_waiting_requests=8) as wide:
        assert "never" in assert_400(post(wide, **{**beam, "best_of": 16}), "best_of")
    assert_ok(post(server, prompt=["a", "b"], **beam))


def test_default_caps_refuse_2048_prompts_of_16_beams() -> None:
    """With the default caps, 2048 prompts x best_of 16 is a 400 naming best_of (not 2048 sequences)."""
    with serve_in_thread(FakeEngine()) as running:
        beam = {"use_beam_search": True, "temperature": 0.0, "n": 1, "best_of": 16}
        huge = post(running, prompt=["a"] * 2048, **beam)
        assert "32768 sequences" in assert_400(huge, "best_of")
        assert_ok(post(running, prompt=["a"] * 2, **beam))


def test_a_request_builds_its_masks_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row of every step of a request gets the request's one PreparedEdits; its blocked-id mask and bias
    tensors are built once and reused; bad words that came tokenized are not tokenized again. The edits equal
    applying allowed_token_ids, bad words and logit_bias one by one."""
    tokenizer = make_char_tokenizer()

    def no_tokenizing(*_: object) -> None:
        raise AssertionError("bad words tokenized on the engine thread")

    monkeypatch.setattr(engine_requests, "tokenize_bad_words", no_tokenizing)
    params = SamplingParams(
        n=2,
        logit_bias={7: 2.0, 9: -1.0},
        allowed_token_ids=(7, 8, 9, 10, 11),
        bad_words=("x", "yz"),
        bad_words_token_ids=((8,), (10, 11)),
    )
    state = RequestState("r", None, (7, 8), params, (), tokenizer, 0.0, seed=1)
    seq_ids = state.seq_ids
    specs = [state.draw_spec(seq_id) for _ in range(3) for seq_id in seq_ids]
    prepared = state.prepared_edits
    assert all(spec.edits.prepared is prepared for spec in specs)
    vocab = 40
    cpu = torch.device("cpu")
    assert prepared.blocked(vocab, cpu) is prepared.blocked(vocab, cpu)
    assert prepared.bias(cpu, torch.float32) is prepared.bias(cpu, torch.float32)
    # After token 10, the two-token bad word bans 11; sample 1 has no output yet.
    state.samples[seq_ids[0]].token_ids.append(10)
    logits = torch.zeros(2, vocab)
    edited = apply_logits_processors(logits, [state.logits_edits(s) for s in seq_ids])
    finite = [sorted(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in edited]
    assert finite == [[7, 9, 10], [7, 9, 10, 11]]
    assert edited[0, 7] == 2.0 and edited[0, 9] == -1.0 and edited[1, 10] == 0.0
    # The same edits given without a prepared form (built for the call) agree.
    plain = LogitsEdits(params.logit_bias, params.allowed_token_ids, ((8,), (10, 11)), output_token_ids=[10])
    assert torch.equal(apply_logits_processors(logits[:1], [plain]), edited[:1])
