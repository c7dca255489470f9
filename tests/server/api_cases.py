"""Bad requests shared by the fake-engine and live-server API tests: (body, the `param` the 400 must name).

Both servers run with MAX_MODEL_LEN; token ids are used where a length must be exact (BPE merges letters).
"""

from __future__ import annotations

import json
from typing import Any

MAX_MODEL_LEN = 64
MODEL = "test-model"  # --served-model-name of every test server

BAD_COMPLETIONS: list[tuple[dict[str, Any], str | None]] = [
    ({"prompt": [5] * (MAX_MODEL_LEN + 1)}, "prompt"),
    ({"prompt": [5] * 10, "max_tokens": MAX_MODEL_LEN - 9}, "max_tokens"),
    ({"prompt": [5] * MAX_MODEL_LEN}, "max_tokens"),  # no room left for even the default max_tokens
    ({"prompt": "hello", "temperature": -0.1}, "temperature"),
    ({"prompt": "hello", "top_p": 0.0}, "top_p"),
    ({"prompt": "hello", "top_p": 1.5}, "top_p"),
    ({"prompt": "hello", "top_k": 0}, "top_k"),
    ({"prompt": "hello", "top_k": -2}, "top_k"),
    ({"prompt": "hello", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "hello", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "hello", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "hello", "min_p": 1.5}, "min_p"),
    ({"prompt": "hello", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hello", "max_tokens": -5}, "max_tokens"),
    ({"prompt": "hello", "max_tokens": 3, "min_tokens": 4}, "min_tokens"),
    ({"prompt": "hello", "n": 17}, "n"),
    ({"prompt": "hello", "n": 0}, "n"),
    ({"prompt": "hello", "logprobs": 21}, "logprobs"),
    ({"prompt": "hello", "stop": [""]}, "stop"),
    ({"prompt": "hello", "stop": ""}, "stop"),
    ({"prompt": "hello", "stop": [str(i) for i in range(17)]}, "stop"),
    ({"prompt": [0, 1, 100000]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [[5, 6], [100000]]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["ok", ""]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": "hello", "stop_token_ids": [99999]}, "stop_token_ids"),
    ({"prompt": "hello", "logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"prompt": "hello", "logit_bias": {"5": -101}}, "logit_bias"),
    ({"prompt": "hello", "logit_bias": {"99999": 1}}, "logit_bias"),
    ({"prompt": "hello", "logit_bias": {"-1": 1}}, "logit_bias"),
    ({"prompt": "hello", "logit_bias": {"five": 1}}, "logit_bias"),
    ({"prompt": "hello", "logit_bias": {"5": "up"}}, "logit_bias"),
    ({"prompt": "hello", "allowed_token_ids": [99999]}, "allowed_token_ids"),
    ({"prompt": "hello", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": "hello", "bad_words": [" "]}, "bad_words"),
    ({"prompt": "hello", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "hello", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "hello", "priority": "high"}, "priority"),
    ({"prompt": "hello", "slo": {"ttft_ms": -1}}, "slo"),
    ({"prompt": "hello", "slo": {"tpot_ms": 0}}, "slo"),
    ({"prompt": "hello", "slo": {"tpot_ms": "fast"}}, "slo"),
    ({"prompt": "hello", "slo": {"deadline_ms": 5}}, "slo"),
    ({"prompt": "hello", "slo": 100}, "slo"),
    ({"prompt": "hello", "suffix": "!"}, "suffix"),
    ({"prompt": "hello", "best_of": 3}, "best_of"),
    ({"prompt": "hello", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"prompt": "hello", "service_tier": "flex"}, "service_tier"),
    ({"prompt": "hello", "no_such_field": 1}, "no_such_field"),
    ({"prompt": "hello", "use_beam_search": True, "n": 3, "best_of": 2}, "n"),
    ({"prompt": "hello", "use_beam_search": True, "stream": True}, "stream"),
    ({"prompt": "hello", "use_beam_search": True, "logprobs": 1}, "logprobs"),
    ({"prompt": "hello", "use_beam_search": True, "temperature": 0.7}, "temperature"),
    ({"prompt": "hello", "length_penalty": 0.5}, "length_penalty"),
    ({"prompt": "hello", "early_stopping": True}, "early_stopping"),
    ({"prompt": "hello", "temperature": "hot"}, "temperature"),
    ({"prompt": "hello", "max_tokens": True}, "max_tokens"),
    ({"prompt": "hello", "seed": 2**70}, "seed"),
    ({"prompt": "hello", "stream": "yes"}, "stream"),
    ({"prompt": {"text": "hello"}}, "prompt"),
    ({}, "prompt"),
]

BAD_CHATS: list[tuple[dict[str, Any], str | None]] = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "hello " * MAX_MODEL_LEN}]}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "url": "x"}]}]}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "slo": {"ttft_ms": -3}}, "slo"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "user", "content": "hi"}], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    (
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
        "tool_choice",
    ),
    ({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low"}, "reasoning_effort"),
    ({"messages": [{"role": "user", "content": "hi"}], "modalities": ["audio"]}, "modalities"),
    ({"messages": [{"role": "user", "content": "hi"}], "audio": {"voice": "x"}}, "audio"),
    ({"messages": [{"role": "user", "content": "hi"}], "prediction": {"type": "content"}}, "prediction"),
    ({"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"1": 1000}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi"}], "bad_words": [""]}, "bad_words"),
    ({"messages": [{"role": "user", "content": "hi"}], "min_tokens": -1}, "min_tokens"),
    (
        {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1, "stream": True},
        "prompt_logprobs",
    ),
    ({"messages": [{"role": "user", "content": "hi"}], "suffix": "x"}, "suffix"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages"),
]

# (raw body, content type, words the error message must contain)
MALFORMED_BODIES: list[tuple[bytes, str, str]] = [
    (b"{not json", "application/json", "not valid JSON"),
    (b"", "application/json", "not valid JSON"),
    (b"[1, 2]", "application/json", "JSON object"),
    (b'"text"', "application/json", "JSON object"),
    (b"null", "application/json", "JSON object"),
    (b'{"prompt": "hi"}', "text/plain", "Content-Type"),
    (b'{"prompt": "hi"}', "application/x-www-form-urlencoded", "Content-Type"),
    (b"\xff\xfe", "application/json", "not valid JSON"),
]

# Non-finite numbers (Python's json accepts them) in sampling fields: (raw body, the field the 400 names).
NON_FINITE_BODIES: list[tuple[bytes, str]] = [
    (b'{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature"),
    (b'{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}', "top_p"),
    (b'{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "min_p": -Infinity}', "min_p"),
]

# --- hostile inputs (issue 18) ---------------------------------------------------------------------------

DEEP = 100_000  # nesting levels: far past the JSON parser's recursion limit
# (path, raw body nested DEEP levels): a 400 saying it is nested too deeply, never a 500.
NESTED_BODIES: list[tuple[str, bytes]] = [
    ("/v1/completions", b"[" * DEEP + b"]" * DEEP),
    ("/v1/completions", b'{"a":' * DEEP + b"1" + b"}" * DEEP),
    ("/v1/completions", b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}"),
    ("/v1/completions", b'{"prompt": "hi", "extra": ' + b'{"a":' * DEEP + b"1" + b"}" * DEEP + b"}"),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": ' + b"[" * DEEP + b"]" * DEEP + b"}]}",
    ),
    ("/tokenize", b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}"),
    ("/detokenize", b'{"tokens": ' + b"[" * DEEP + b"]" * DEEP + b"}"),
]

SURROGATE = "\ud800"  # a lone UTF-16 surrogate half: valid JSON as an escape, not valid text
_HI: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
# (path, body, the param the 400 names) with a lone surrogate in every string field the API reads.
SURROGATE_BODIES: list[tuple[str, dict[str, Any], str | None]] = [
    ("/v1/completions", {"prompt": SURROGATE}, "prompt"),
    ("/v1/completions", {"prompt": "a" + SURROGATE + "b", "echo": True}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", SURROGATE]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": SURROGATE}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x", SURROGATE]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "user": SURROGATE}, "user"),
    ("/v1/completions", {"prompt": "hi", "model": SURROGATE}, "model"),
    ("/v1/completions", {"prompt": "hi", SURROGATE: 1}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SURROGATE}]}, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]},
        "messages",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi", "name": SURROGATE}]},
        "messages",
    ),
    ("/v1/chat/completions", {"messages": [{"role": SURROGATE, "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": _HI, "stop": [SURROGATE]}, "stop"),
    ("/v1/chat/completions", {"messages": _HI, "model": SURROGATE}, "model"),
    ("/tokenize", {"prompt": SURROGATE}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": SURROGATE}]}, "messages"),
    ("/tokenize", {"prompt": "hi", "model": SURROGATE}, "model"),
    ("/detokenize", {"tokens": [5], "model": SURROGATE}, "model"),
]


def surrogate_body(body: dict[str, Any]) -> bytes:
    """`body` as JSON with the surrogate escaped (`\\ud800`), as a hostile client sends it."""
    return json.dumps({"model": MODEL, **body}).encode()  # ensure_ascii: every non-ASCII char is escaped
