"""Each architecture, loaded by `load_model`, against its Hugging Face implementation on paged varlen batches."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from unittest import mock

import pytest
import torch
from pagoda.pagedkernel import KernelBackend
from pagoda.server.loader import load_model
from pagoda.server.models import Attention, CausalLM, KVCacheSpec, build_model
from pagoda.server.models.layers import Linear, linear, pack_weight, packable_dtypes
from pagoda.server.testing import (
    ARCHS,
    MODEL_VOCAB_SIZE,
    PagedKV,
    make_tiny_hf_model,
    make_tiny_model,
    tiny_config,
)
from torch import Tensor
from transformers import AutoModelForCausalLM, PreTrainedModel

ATOL = 1e-4
CPU = torch.device("cpu")


def random_tokens(n: int, seed: int) -> list[int]:
    """`n` token ids from the model vocabulary (special ids included: they are ordinary rows here)."""
    return torch.randint(0, MODEL_VOCAB_SIZE, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(hf_model: PreTrainedModel, tokens: Sequence[int]) -> Tensor:
    """Hugging Face logits at every position of one sequence: float32 [len(tokens), vocab]."""
    with torch.no_grad():
        logits: Tensor = hf_model(torch.tensor([list(tokens)])).logits[0].float()
    return logits


def load_pair(path: Path) -> tuple[CausalLM, PreTrainedModel]:
    """Our model and the Hugging Face reference (eager attention, which honours sliding windows) from one folder."""
    ours = load_model(str(path), dtype=torch.float32, device=CPU).model
    reference = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    return ours, reference


@pytest.mark.parametrize("arch", ARCHS)
def test_varlen_prefill_then_batched_decode_match_hf(
    arch: str, tiny_model_path: Callable[[str], Path], torch_backend: KernelBackend
) -> None:
    """Three prompts (crossing 4-token blocks and the sliding window) in one forward, then decode steps."""
    model, reference = load_pair(tiny_model_path(arch))
    kv = PagedKV(model.kv_cache_spec(), torch_backend, block_size=4)
    seqs = {0: random_tokens(13, 1), 1: random_tokens(5, 2), 2: random_tokens(21, 3)}
    got = [kv.run(model, list(seqs.items()))]
    for step in range(3):
        new = {seq_id: random_tokens(1, 100 + 10 * step + seq_id) for seq_id in seqs}
        got.append(kv.run(model, list(new.items())))
        for seq_id, token in new.items():
            seqs[seq_id] = seqs[seq_id] + token
    for seq_id, tokens in seqs.items():
        want = hf_logits(reference, tokens)
        for step, logits in enumerate(got):
            position = len(tokens) - len(got) + step
            torch.testing.assert_close(logits[seq_id], want[position], atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_beside_a_decode_matches_hf(
    arch: str, tiny_model_path: Callable[[str], Path], torch_backend: KernelBackend
) -> None:
    """A prompt split over two forwards (block size 8), its second chunk batched with another sequence's decode."""
    model, reference = load_pair(tiny_model_path(arch))
    kv = PagedKV(model.kv_cache_spec(), torch_backend, block_size=8)
    long, short = random_tokens(23, 4), random_tokens(6, 5)
    first = kv.run(model, [(0, long[:11]), (1, short)])
    decode = random_tokens(1, 6)
    second = kv.run(model, [(1, decode), (0, long[11:])])
    want_long, want_short = hf_logits(reference, long), hf_logits(reference, short + decode)
    torch.testing.assert_close(first[0], want_long[10], atol=ATOL, rtol=0)
    torch.testing.assert_close(first[1], want_short[5], atol=ATOL, rtol=0)
    torch.testing.assert_close(second[0], want_short[6], atol=ATOL, rtol=0)
    torch.testing.assert_close(second[1], want_long[22], atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_f_linear(dtype: torch.dtype) -> None:
    """The CPU linear (oneDNN for float32) is F.linear: 3-D and strided inputs, with and without bias, empty batches."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=gen).to(dtype)
    bias = torch.randn(48, generator=gen).to(dtype)
    strided = torch.randn(7, 64, generator=gen).to(dtype)[:, ::2]
    inputs = [torch.randn(2, 5, 32, generator=gen).to(dtype), strided, torch.empty(0, 32, dtype=dtype)]
    for x in inputs:
        for b in (None, bias):
            got = linear(x, weight, b)
            assert got.dtype == dtype and got.shape == (*x.shape[:-1], 48)
            tol = 1e-5 if dtype == torch.float32 else 0.0
            torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weights_give_the_same_products(dtype: torch.dtype) -> None:
    """A Linear packed into oneDNN's layout (float32, and bfloat16 where oneDNN runs it natively, on the CPU)
    frees the plain weight and computes the same outputs (float32 up to rounding: another kernel may sum in another
    order; bfloat16 bit for bit), for batches above and below the packing hint; other dtypes are left alone."""
    if dtype not in packable_dtypes():
        assert pack_weight(torch.randn(4, 4).to(dtype), 16) is None
        pytest.skip(f"oneDNN does not run {dtype} natively on this CPU")
    gen = torch.Generator().manual_seed(0)
    layer = Linear(32, 48, bias=True, dtype=dtype, device=CPU)
    layer.weight.data.copy_(torch.randn(48, 32, generator=gen))
    assert layer.bias is not None
    layer.bias.data.copy_(torch.randn(48, generator=gen))
    inputs = [torch.randn(n, 32, generator=gen).to(dtype) for n in (1, 7, 300)]
    inputs.append(torch.randn(2, 5, 32, generator=gen).to(dtype))
    before = [layer(x) for x in inputs]
    assert layer.pack(16)
    assert layer.weight.is_mkldnn and layer.weight.shape == (48, 32)
    tol = 1e-5 if dtype == torch.float32 else 0.0
    for x, want in zip(inputs, before, strict=True):
        torch.testing.assert_close(layer(x), want, atol=tol, rtol=tol)
    assert not layer.pack(16)  # already packed
    assert pack_weight(torch.randn(4, 4).to(torch.float16), 16) is None


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_pack_weights_keeps_the_model_outputs(arch: str, tiny_model_path: Callable[[str], Path]) -> None:
    """Packing a loaded model (Llama: untied head; Gemma 3: tied, the embedding stays plain for the lookups)
    keeps its logits (up to float32 rounding)."""
    model = load_model(str(tiny_model_path(arch)), dtype=torch.float32, device=CPU).model
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    before = model.compute_logits(hidden)
    linears = sum(isinstance(m, Linear) for m in model.modules())
    assert model.pack_weights(8) == linears + (arch == "gemma3")
    torch.testing.assert_close(model.compute_logits(hidden), before, atol=1e-5, rtol=1e-5)
    embed = model.get_submodule("model.embed_tokens").get_parameter("weight")
    assert not embed.is_mkldnn


@pytest.mark.parametrize(
    ("arch", "spec"),
    [("llama", KVCacheSpec(2, 2, 16)), ("qwen3", KVCacheSpec(2, 2, 24)), ("gemma3", KVCacheSpec(3, 2, 32))],
)
def test_kv_cache_spec(arch: str, spec: KVCacheSpec) -> None:
    """The cache layout follows the config: layers, KV heads and head size."""
    assert build_model(tiny_config(arch), torch.float32, CPU).kv_cache_spec() == spec


def test_compute_logits_shape_dtype_and_softcap(tiny_model_path: Callable[[str], Path]) -> None:
    """compute_logits maps [N, hidden] to [N, vocab]: float32 once soft-capped, for bfloat16 models too."""
    model = load_model(str(tiny_model_path("gemma3")), dtype=torch.bfloat16, device=CPU).model
    logits = model.compute_logits(torch.randn(3, 64, dtype=torch.bfloat16))
    assert logits.shape == (3, MODEL_VOCAB_SIZE) and logits.dtype == torch.float32
    assert float(logits.abs().max()) <= 2.0  # the tiny Gemma's final_logit_softcapping
    llama = load_model(str(tiny_model_path("llama")), dtype=torch.bfloat16, device=CPU).model
    assert (
        llama.compute_logits(torch.randn(2, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16
    )  # no softcap


def test_bfloat16_model_tracks_float32(
    tiny_model_path: Callable[[str], Path], torch_backend: KernelBackend
) -> None:
    """The same prompt through bfloat16 weights and caches stays close to float32 (the GPU dtype path)."""
    path = tiny_model_path("qwen3")
    tokens = random_tokens(9, 7)
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(str(path), dtype=dtype, device=CPU).model
        kv = PagedKV(model.kv_cache_spec(), torch_backend, dtype=dtype)
        results.append(kv.run(model, [(0, tokens)]))
    torch.testing.assert_close(results[1].float(), results[0], atol=0.15, rtol=0.05)


def test_attention_passes_window_softcap_and_scale(torch_backend: KernelBackend) -> None:
    """Attention writes K/V, then hands its layer's scale, sliding window and logit softcap to the kernel."""
    spy = mock.Mock(wraps=torch_backend)
    kv = PagedKV(KVCacheSpec(1, 1, 8), torch_backend)
    attn = dataclasses.replace(kv.step([(0, [1, 2, 3])]).attn, backend=spy)
    layer = Attention(num_heads=2, num_kv_heads=1, head_dim=8, scale=0.5, sliding_window=2, logit_softcap=5.0)
    q, k, v = torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    out = layer(q, k, v, kv.kv_caches[0], attn)
    assert out.shape == (3, 16)
    spy.reshape_and_cache.assert_called_once()
    prefill = spy.paged_prefill_attention.call_args
    assert prefill.args[6] == 0.5
    assert prefill.kwargs == {"sliding_window": 2, "logit_softcap": 5.0}
    spy.paged_decode_attention.assert_not_called()


def test_attention_uses_the_decode_kernel_for_decode_steps(torch_backend: KernelBackend) -> None:
    """is_decode routes to paged_decode_attention, with the layer's options."""
    spy = mock.Mock(wraps=torch_backend)
    kv = PagedKV(KVCacheSpec(1, 1, 8), torch_backend)
    kv.step([(0, [1, 2, 3]), (1, [4])])
    attn = dataclasses.replace(kv.step([(0, [5]), (1, [6])]).attn, backend=spy)
    assert attn.is_decode
    layer = Attention(
        num_heads=2, num_kv_heads=1, head_dim=8, scale=0.25, sliding_window=None, logit_softcap=None
    )
    out = layer(torch.randn(2, 2, 8), torch.randn(2, 1, 8), torch.randn(2, 1, 8), kv.kv_caches[0], attn)
    assert out.shape == (2, 16)
    decode = spy.paged_decode_attention.call_args
    assert decode.args[5] == 0.25
    assert decode.kwargs == {"sliding_window": None, "logit_softcap": None}
    spy.paged_prefill_attention.assert_not_called()


def test_gemma3_attention_softcap_reaches_every_layer() -> None:
    """attn_logit_softcapping from the config is each Gemma 3 layer's kernel softcap."""
    model = build_model(tiny_config("gemma3", attn_logit_softcapping=30.0), torch.float32, CPU)
    softcaps = {m.logit_softcap for m in model.modules() if isinstance(m, Attention)}
    windows = [m.sliding_window for m in model.modules() if isinstance(m, Attention)]
    assert softcaps == {30.0}
    assert windows == [8, None, 8]


def test_dynamic_rope_is_refused() -> None:
    """Sequence-length dependent rope would differ across a paged batch: refused with a clear error."""
    config = tiny_config(
        "llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    )
    with pytest.raises(NotImplementedError, match="dynamic"):
        build_model(config, torch.float32, CPU)


def test_tiny_hf_models_are_deterministic() -> None:
    """The factory's fixed seed gives the same weights every time (tests compare across processes)."""
    first, second = make_tiny_hf_model("qwen2").state_dict(), make_tiny_hf_model("qwen2").state_dict()
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_untied_gemma3_uses_its_lm_head(tmp_path: Path, torch_backend: KernelBackend) -> None:
    """A Gemma 3 checkpoint with its own lm_head (tie_word_embeddings false) uses it, as Hugging Face does."""
    model, reference = load_pair(make_tiny_model("gemma3", tmp_path, tie_word_embeddings=False))
    tokens = random_tokens(11, 8)
    logits = PagedKV(model.kv_cache_spec(), torch_backend).run(model, [(0, tokens)])[0]
    torch.testing.assert_close(logits, hf_logits(reference, tokens)[-1], atol=ATOL, rtol=0)


def test_bidirectional_gemma3_is_refused() -> None:
    """EmbeddingGemma-style bidirectional attention is not causal generation: refused with a clear error."""
    with pytest.raises(NotImplementedError, match="bidirectional"):
        build_model(tiny_config("gemma3", use_bidirectional_attention=True), torch.float32, CPU)
