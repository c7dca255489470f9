"""Issue 16's sampling fields, echo + logprobs, prompt_logprobs and vLLM's metrics, through the official OpenAI
client against `pagoda serve` on a tiny random Llama (float32, --metrics-prefix vllm)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import openai
import pytest
import torch
from api_cases import MAX_MODEL_LEN, MODEL
from pagoda.server.testing import make_tiny_model
from test_api_live import LiveServer, serving, sync_client
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPT = [1, 17, 42, 99, 7, 250, 31, 64, 5, 77, 120, 200]
NO_EOS: dict[str, Any] = {"ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("fields") / "llama")


@pytest.fixture(scope="module")
def live(model_dir: Path) -> Iterator[LiveServer]:
    """One server for the module, with vLLM's metric names and the priority policy."""
    with serving(
        model_dir,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--metrics-prefix",
        "vllm",
        "--scheduling-policy",
        "priority",
    ) as server:
        yield server


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    """The official synchronous OpenAI client."""
    return sync_client(live)


@pytest.fixture(scope="module")
def hf_logprobs(model_dir: Path) -> torch.Tensor:  # [len(PROMPT) - 1]
    """transformers' float32 log-softmax of PROMPT's logits at each prompt token after the first."""
    model = cast(Any, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(PROMPT[1:]).unsqueeze(1)).squeeze(1)


def test_logit_bias_forces_greedy_token(client: openai.OpenAI, model_dir: Path) -> None:
    """logit_bias +100 on one id (OpenAI's string keys) makes greedy output that id only."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    plain = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, extra_body=NO_EOS
    )
    result = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        logprobs=0,
        logit_bias={"200": 100},
        extra_body=NO_EOS,
    )
    assert result.choices[0].logprobs is not None
    assert result.choices[0].logprobs.tokens == [tokenizer.decode([200])] * 5
    assert plain.choices[0].text != result.choices[0].text


def test_bad_words_and_allowed_token_ids(client: openai.OpenAI, model_dir: Path) -> None:
    """A bad word never appears even under a +100 bias; allowed_token_ids bound random sampling."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    target = next(
        t for t in range(100, 384) if tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False) == [t]
    )
    word = tokenizer.decode([target])
    chat: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "temperature": 0,
        "logit_bias": {str(target): 100},
        "logprobs": True,
    }
    for extra, expected in [({}, [word] * 4), ({"bad_words": [word]}, None)]:
        result = client.chat.completions.create(**chat, extra_body={**NO_EOS, **extra})
        content = result.choices[0].logprobs.content if result.choices[0].logprobs else None
        assert content is not None and len(content) == 4
        tokens = [t.token for t in content]
        assert tokens == expected if expected is not None else word not in tokens
    allowed = [40, 41, 42]
    texts = {tokenizer.decode([t]) for t in allowed}
    sampled = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        n=3,
        logprobs=0,
        extra_body={**NO_EOS, "allowed_token_ids": allowed},
    )
    for choice in sampled.choices:
        assert choice.logprobs is not None and choice.logprobs.tokens is not None
        assert len(choice.logprobs.tokens) == 6 and set(choice.logprobs.tokens) <= texts


def test_min_tokens_in_chat(client: openai.OpenAI, model_dir: Path) -> None:
    """With eos biased +100 a chat stops at once; min_tokens holds it off until that many tokens."""
    eos = AutoTokenizer.from_pretrained(model_dir).eos_token_id
    chat: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "temperature": 0,
        "logit_bias": {str(eos): 100},
    }
    stopped = client.chat.completions.create(**chat)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage is not None
    assert stopped.usage.completion_tokens == 1
    held = client.chat.completions.create(**chat, extra_body={"min_tokens": 4})
    assert held.usage is not None and held.usage.completion_tokens == 5  # four held off, then eos
    assert held.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_in_lm_eval_shape(
    client: openai.OpenAI, hf_logprobs: torch.Tensor, max_tokens: int
) -> None:
    """lm-evaluation-harness's loglikelihood request (echo, logprobs=1, max_tokens 0 or 1): token_logprobs covers
    the prompt, first null, then transformers' log-softmax within 1e-4; max_tokens 0 shows no generated token."""
    result = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=1,
        echo=True,
        extra_body=NO_EOS,
    )
    # The client types the entries as never null: the prompt's first is.
    logprobs = cast(Any, result.choices[0].logprobs)
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert len(logprobs.token_logprobs) == len(PROMPT) + max_tokens
    top_logprobs = logprobs.top_logprobs
    assert logprobs.token_logprobs[0] is None and top_logprobs[0] is None
    prompt_part = logprobs.token_logprobs[1 : len(PROMPT)]
    assert all(v is not None for v in prompt_part)
    torch.testing.assert_close(torch.tensor(prompt_part), hf_logprobs, atol=1e-4, rtol=0)
    assert all(top is not None and len(top) == 1 for top in top_logprobs[1:])
    assert result.usage is not None and result.usage.completion_tokens == max_tokens
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=max_tokens, logprobs=1, echo=True, temperature=0, stream=True
    )
    token_logprobs: list[float | None] = []
    for chunk in streamed:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            token_logprobs += chunk.choices[0].logprobs.token_logprobs or []
    assert token_logprobs == logprobs.token_logprobs


def test_prompt_logprobs_extra_field(client: openai.OpenAI, hf_logprobs: torch.Tensor) -> None:
    """vLLM's prompt_logprobs on completions and chat: per position a dict by token id, first null."""
    result = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2, **NO_EOS}
    )
    entries = cast(Any, result.choices[0]).prompt_logprobs
    assert entries[0] is None and len(entries) == len(PROMPT)
    got = [entry[str(token)]["logprob"] for token, entry in zip(PROMPT[1:], entries[1:], strict=True)]
    torch.testing.assert_close(torch.tensor(got), hf_logprobs, atol=1e-4, rtol=0)
    assert all(len(entry) in (2, 3) for entry in entries[1:])  # the prompt token and the top 2
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )
    chat_entries = cast(Any, chat).prompt_logprobs
    assert chat_entries[0] is None and len(chat_entries) > 1 and all(len(e) == 1 for e in chat_entries[1:])


def test_unknown_and_unserved_fields_are_400(client: openai.OpenAI) -> None:
    """The openai client's own parameters Pagoda does not serve are 400s naming them; then a request succeeds."""
    messages: Any = [{"role": "user", "content": "hi"}]
    tool: Any = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    cases: list[tuple[dict[str, Any], str]] = [
        # Tools mean tool_choice "auto", which needs --enable-auto-tool-choice.
        ({"tools": [tool]}, "tool_choice"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"extra_body": {"frobnicate": True}}, "frobnicate"),
        ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, **kwargs)
        assert cast(Any, error.value.body)["param"] == param
    ok = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=1,
        user="u",
        metadata={"k": "v"},
        store=False,
        tool_choice="none",
        extra_body={"priority": -5},
    )
    assert ok.choices[0].finish_reason is not None


def test_vllm_metrics_names(live: LiveServer, client: openai.OpenAI) -> None:
    """--metrics-prefix vllm exposes vLLM's names: success by finish reason, phase histograms, TPOT, tokens per
    iteration, the cache config info."""
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, extra_body=NO_EOS)
    text = httpx.get(f"{live.base_url}/metrics").text
    for name in [
        'vllm:request_success_total{finished_reason="length",model_name="test-model"}',
        'vllm:request_queue_time_seconds_count{model_name="test-model"}',
        'vllm:request_prefill_time_seconds_count{model_name="test-model"}',
        'vllm:request_decode_time_seconds_count{model_name="test-model"}',
        'vllm:request_inference_time_seconds_count{model_name="test-model"}',
        'vllm:time_per_output_token_seconds_count{model_name="test-model"}',
        'vllm:iteration_tokens_total_count{model_name="test-model"}',
        "vllm:cache_config_info{block_size=",
        'vllm:num_requests_running{model_name="test-model"}',
        'vllm:time_to_first_token_seconds_count{model_name="test-model"}',
    ]:
        assert name in text, name
    assert "pagoda:" not in text
    success = next(line for line in text.splitlines() if line.startswith("vllm:request_success_total{"))
    assert float(success.rsplit(" ", 1)[1]) >= 1
