"""Fixtures for the server tests: tiny model folders built once per session, an isolated GGUF cache, LLMs shut down
after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mixed_gguf import MixedGGUFs
from pagoda.pagedkernel import KernelBackend, get_backend
from pagoda.server.llm import LLM
from pagoda.server.loader import CACHE_DIR_ENV
from pagoda.server.testing import make_tiny_model, make_tiny_tokenizer
from pagoda.server.testing.tiny_gguf import write_tiny_gguf
from ray_head import ray_head
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`tiny_model_path(arch)`: the folder of the tiny `arch` model (see pagoda.server.testing.ARCHS), built on first use."""
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = make_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))
        return built[arch]

    return get


@pytest.fixture(scope="session")
def torch_backend() -> KernelBackend:
    """The reference (torch) kernel backend."""
    return get_backend("torch", "cpu")


@pytest.fixture
def gguf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty GGUF conversion cache for one test, also set as $PAGODA_CACHE_DIR."""
    root = tmp_path / "pagoda-cache"
    monkeypatch.setenv(CACHE_DIR_ENV, str(root))
    return root


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel]:
    """A tiny Llama written as an F32 GGUF by gguf's writer, and the Hugging Face model it was written from."""
    return write_tiny_gguf("llama", tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf", lambda name: "F32")


@pytest.fixture(scope="session")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> MixedGGUFs:
    """`mixed_gguf(arch, types, embedding="Q8_0")`: a tiny GGUF of `arch` whose matrices cycle through the block
    formats `types` (neighbours differ: fused q/k/v and gate/up mix them), each written once per session."""
    return MixedGGUFs(tmp_path_factory)


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    """The tiny test tokenizer (the fake-model engine tests'; a module may define its own `tokenizer`)."""
    path = tmp_path_factory.mktemp("tokenizer")
    make_tiny_tokenizer(path)
    loaded: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(path)
    return loaded


@pytest.fixture
def ray_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A local Ray cluster of 2 CPUs for one test (`ray_head`: started outside this process, never forked from
    it), this process a driver of it, and RAY_ADDRESS pointing a server started meanwhile at it."""
    import ray

    with ray_head(num_cpus=2) as head:
        # address="auto" finds the head through RAY_TMPDIR and, being the local cluster, takes its token and turns
        # token mode on in Ray's cached config (an explicit address never does; a mode set beforehand is believed
        # without that refresh). The environment is restored after the test.
        monkeypatch.setenv("RAY_TMPDIR", str(head.tmpdir))
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
        ray.init(address="auto")
        monkeypatch.setenv("RAY_ADDRESS", head.address)
        try:
            yield head.address
        finally:
            ray.shutdown()


@pytest.fixture
def llms() -> Iterator[Callable[..., LLM]]:
    """`llms(make, *args, **kwargs)`: an LLM built by `make`, shut down (workers stopped) after the test (the tensor
    parallel and AFD tests, whose workers must not outlive it)."""
    built: list[LLM] = []

    def build(make: Callable[..., LLM], *args: Any, **kwargs: Any) -> LLM:
        llm = make(*args, **kwargs)
        built.append(llm)
        return llm

    yield build
    for llm in built:
        llm.engine.close()
