"""LoRA on the embedding and the LM head: greedy tokens equal transformers + PEFT (float32) on the tiny llama
(untied head) and gemma3 (tied head: the adapter applies to the logits only, and gemma's embedding scale to the
embedding delta too), adapters on them mixed with another adapter and the base in one batch; TP=2 equals TP=1;
what PEFT can save that is not served (modules_to_save, new-token embeddings) is refused naming the module."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from pagoda.server.llm import LLM
from pagoda.server.lora import LoRAError, LoRARequest
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import make_tiny_model
from pagoda.server.testing.tiny_lora import greedy, make_tiny_lora, peft_reference
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

pytest.importorskip("peft")

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# e: the embedding, the LM head and two projections; h: the LM head alone (on gemma3 the tied one).
TARGETS = {"e": ("embed_tokens", "lm_head", "q_proj", "down_proj"), "h": ("lm_head",)}
IDS = {"e": 1, "h": 2}
SCALES = {"e": 0.5, "h": 1.0}


def prompts(lengths: Sequence[int], seed: int) -> list[list[int]]:
    """Token-id prompts of the given lengths (clear of the special ids)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


class Setup:
    """A tiny base model, the adapters e and h on it, and the references (computed lazily, cached)."""

    def __init__(self, root: Path, arch: str) -> None:
        self.base = make_tiny_model(arch, root / "base")
        self.paths = {
            # h's deltas are larger: a random gemma3's soft-capped logits have wide margins (not so large that they saturate
            # the cap of 2 and tie).
            name: make_tiny_lora(
                self.base,
                root / name,
                rank=4,
                seed=IDS[name] + 10,
                target_modules=targets,
                scale=SCALES[name],
            )
            for name, targets in TARGETS.items()
        }
        self._models: dict[str, PreTrainedModel] = {}
        self._cache: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def request(self, name: str) -> LoRARequest:
        """The LoRARequest of adapter `name`."""
        return LoRARequest(name, IDS[name], str(self.paths[name]))

    def reference(self, name: str | None, prompt: Sequence[int]) -> list[int]:
        """Greedy tokens of transformers (+ PEFT for an adapter) for one prompt alone."""
        key = (name or "base", tuple(prompt))
        if key not in self._cache:
            if key[0] not in self._models:
                self._models[key[0]] = (
                    AutoModelForCausalLM.from_pretrained(
                        self.base, attn_implementation="eager", dtype=torch.float32
                    )
                    if name is None
                    else peft_reference(self.base, self.paths[name])
                )
            self._cache[key] = greedy(self._models[key[0]], prompt, MAX_TOKENS)
        return self._cache[key]


@pytest.fixture(scope="module")
def setups(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Setup]:
    """One Setup per architecture."""
    root = tmp_path_factory.mktemp("lora-vocab")
    return {arch: Setup(root / arch, arch) for arch in ("llama", "gemma3")}


def make_llm(base: Path, **kwargs: object) -> LLM:
    """A float32 LoRA engine on a tiny model with 4-token blocks and two adapter slots."""
    args: dict[str, object] = {
        "block_size": 4,
        "num_kv_blocks": 256,
        "max_model_len": 64,
        "dtype": "float32",
        "enable_lora": True,
        "max_loras": 2,
    }
    args.update(kwargs)
    return LLM(str(base), **args)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_embedding_and_head_adapters_mixed_with_the_base_equal_peft(
    arch: str, setups: dict[str, Setup]
) -> None:
    """Requests for e, h and the base in one batch (chunked prefill: the embedding delta on prompt rows, the
    head delta on sampled rows only) each get transformers + PEFT's tokens, which differ from the base's."""
    setup = setups[arch]
    llm = make_llm(setup.base, max_num_batched_tokens=24)
    batch = prompts([9, 13, 7, 11, 10, 8], seed=21)
    loras: list[LoRARequest | None] = [setup.request("e"), setup.request("h"), None] * 2
    outs = llm.generate(batch, GREEDY, use_tqdm=False, lora_request=loras)
    for out, prompt, lora in zip(outs, batch, loras, strict=True):
        name = None if lora is None else lora.lora_name
        assert list(out.outputs[0].token_ids) == setup.reference(name, prompt), name
    for name in ("e", "h"):
        assert setup.reference(name, batch[0]) != setup.reference(None, batch[0]), f"{name} changes nothing"
    manager = None if llm.engine.lora is None else llm.engine.lora.manager
    assert (
        manager is not None
        and manager.hooks["lm_head"].used[0]
        and manager.hooks["model.embed_tokens"].used[0]
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tp2_with_embedding_and_head_adapters_equals_tp1(arch: str, setups: dict[str, Setup]) -> None:
    """Two ranks (A of the embedding cut to each rank's vocabulary run, B of the head to its rows) give TP=1's
    tokens for e, h and the base in one batch."""
    setup = setups[arch]
    batch = prompts([9, 12, 7], seed=22)
    loras = [setup.request("e"), setup.request("h"), None]
    want = [setup.reference(None if r is None else r.lora_name, p) for r, p in zip(loras, batch, strict=True)]
    tp2 = make_llm(setup.base, tensor_parallel_size=2)
    try:
        outs = tp2.generate(batch, GREEDY, use_tqdm=False, lora_request=loras)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
    finally:
        tp2.engine.close()


def _copy(src: Path, dst: Path) -> Path:
    """A copy of an adapter folder to edit."""
    dst.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


def test_unserved_peft_parts_are_refused_naming_the_module(setups: dict[str, Setup], tmp_path: Path) -> None:
    """modules_to_save, trainable_token_indices and a saved embedding of another vocabulary size (new tokens)
    are LoRAErrors naming lora_path and the module; the engine keeps serving the good adapter."""
    setup = setups["llama"]
    llm = make_llm(setup.base)
    src = setup.paths["e"]

    saved = _copy(src, tmp_path / "saved")
    config = json.loads((saved / "adapter_config.json").read_text())
    (saved / "adapter_config.json").write_text(json.dumps({**config, "modules_to_save": ["score"]}))
    tokens = _copy(src, tmp_path / "tokens")
    (tokens / "adapter_config.json").write_text(
        json.dumps({**config, "trainable_token_indices": {"embed_tokens": [3, 4]}})
    )
    resized = _copy(src, tmp_path / "resized")
    tensors = load_file(str(resized / "adapter_model.safetensors"))
    key = "base_model.model.model.embed_tokens.base_layer.weight"
    assert key in tensors, sorted(tensors)
    tensors[key] = torch.cat([tensors[key], tensors[key][:2]])
    save_file(tensors, str(resized / "adapter_model.safetensors"))

    for lora_id, (folder, words) in enumerate(
        [(saved, "modules_to_save (score"), (tokens, "trainable_token_indices"), (resized, "embed_tokens")],
        start=5,
    ):
        with pytest.raises(LoRAError) as info:
            llm.engine.add_lora(LoRARequest(folder.name, lora_id, str(folder)))
        assert info.value.param == "lora_path" and words in str(info.value), str(info.value)
    prompt = prompts([8], seed=23)[0]
    out = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=setup.request("e"))
    assert list(out[0].outputs[0].token_ids) == setup.reference("e", prompt)
