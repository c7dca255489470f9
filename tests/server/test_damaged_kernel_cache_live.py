"""A damaged kernel cache does not fail the first request (issue 43, finding 13): a server started over a cache
whose every `.so` was cut to half after a first warm start rebuilds what it loads and answers 200."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from api_cases import MODEL
from pagoda.server.testing import LiveServer, make_tiny_model
from test_api_live import ROOT, TEST_FLAGS


def _server(model: Path, cache: Path) -> LiveServer:
    """`pagoda serve` of `model` with its C kernels in `cache`."""
    env = {**os.environ, "PAGODA_KERNEL_CACHE": str(cache)}
    return LiveServer(model, TEST_FLAGS, served_model_name=MODEL, cwd=ROOT, env=env)


def _complete(server: LiveServer, temperature: float) -> httpx.Response:
    body = {
        "model": MODEL,
        "prompt": "hello",
        "max_tokens": 4,
        "temperature": temperature,
        "ignore_eos": True,
    }
    return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, dict[Path, int]]]:
    """A server started over a cache it warmed once, every library of which was then cut to half; with the
    libraries' whole sizes."""
    model = make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")
    cache = tmp_path_factory.mktemp("kernels")
    warm = _server(model, cache)
    try:
        assert _complete(warm, 1.0).status_code == 200
    finally:
        assert warm.stop() == 0
    sizes = {path: path.stat().st_size for path in cache.glob("*.so")}
    assert any("cpu_sampling" in path.name for path in sizes), sorted(sizes)
    for path, size in sizes.items():
        path.write_bytes(path.read_bytes()[: size // 2])
    server = _server(model, cache)
    try:
        yield server, sizes
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["sampled", "greedy"])
def test_the_first_completions_over_a_damaged_cache_answer_200(
    damaged: tuple[LiveServer, dict[Path, int]], temperature: float
) -> None:
    """Sampled (the C sampler) and greedy completions answer 200 with tokens; no engine restart."""
    server, _ = damaged
    response = _complete(server, temperature)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    assert "restart" not in server.log_tail(200).lower(), server.log_tail()


def test_the_server_rebuilt_what_it_loads(damaged: tuple[LiveServer, dict[Path, int]]) -> None:
    """The libraries the server loads (attention, sampling) are whole again in the cache, and its log says they
    were compiled again."""
    server, sizes = damaged
    assert _complete(server, 1.0).status_code == 200
    for path, size in sizes.items():
        if path.name.startswith(("cpu_attention", "cpu_sampling")):
            assert path.stat().st_size == size, path
    assert "compiling it again" in server.log_tail(200), server.log_tail()
