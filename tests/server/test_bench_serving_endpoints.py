"""tools/bench_serving.py --endpoint (issues 26, 42): completions, chat completions, responses and Anthropic
messages streams are timed alike against a fake server; several endpoints become one column each."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from api_fake_engine import FakeEngine, serve_in_thread
from pagoda.server.bench import serving as bench_serving


def test_every_endpoint_streams_and_counts_tokens() -> None:
    """Each endpoint's stream is read to its usage: the same token counts, a first token, inter-token gaps."""
    args = bench_serving.parse_args(["--model", "test-model", "--ignore-eos", "--temperature", "0"])
    request = bench_serving.BenchRequest("hello there", 6)
    with serve_in_thread(FakeEngine(step_seconds=0.005)) as running:

        async def one(endpoint: str) -> object:
            result = bench_serving.RequestResult()
            target = bench_serving.Target(running.base_url, "test-model", endpoint, endpoint=endpoint)
            async with httpx.AsyncClient(timeout=30) as client:
                await bench_serving.send(client, args, target, request, result)
            return result

        for endpoint in bench_serving.ENDPOINTS:
            result = asyncio.run(one(endpoint))
            assert result.success, (endpoint, result.error)  # type: ignore[attr-defined]
            assert result.output_tokens == 6 and result.prompt_tokens > 0  # type: ignore[attr-defined]
            assert result.ttft > 0 and len(result.itl) >= 1  # type: ignore[attr-defined]


def test_responses_bodies_and_labels() -> None:
    """The responses body carries input, max_output_tokens and text.format; several endpoints label columns."""
    args = bench_serving.parse_args(
        ["--model", "m", "--endpoint", "/v1/chat/completions", "/v1/responses", "--structured", "json_schema"]
    )
    targets = bench_serving.targets(args)
    assert [t.label for t in targets] == [
        "127.0.0.1:8000 chat/completions",
        "127.0.0.1:8000 chat/completions json_schema",
        "127.0.0.1:8000 responses",
        "127.0.0.1:8000 responses json_schema",
    ]
    body = bench_serving.request_body(args, targets[3], bench_serving.BenchRequest("hi", 4))
    assert (body["input"], body["max_output_tokens"], body["text"]["format"]["type"]) == (
        "hi",
        4,
        "json_schema",
    )
    chat = bench_serving.request_body(args, targets[0], bench_serving.BenchRequest("hi", 4))
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and chat["max_tokens"] == 4
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--model", "m", "--endpoint", "/v1/embeddings"])
