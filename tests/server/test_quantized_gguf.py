"""`--quantization gguf`: a GGUF's block formats kept in the cache and in the layers, against the dequantized model.

The reference is the same file with `--quantization none` (today's path: every weight dequantized to float32).
With the `torch` quantized ops the arithmetic is exact (the dequantized weights times float32 activations), so
greedy tokens must be equal. The `cpu` ops quantize activations to int8 for up to 16 rows: there the logits are
bounded instead (see `INT8_LOGIT_BOUND`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from mixed_gguf import MixedGGUFs
from pagoda.pagedkernel import KernelBackend
from pagoda.pagedkernel.quant import (
    GGMLType,
    QuantBackendName,
    cpu_quant,
    dequantize,
    qmatmul,
    repack,
    torch_quant,
)
from pagoda.pagedkernel.quant.cpu_quant import GEMV_MAX_ROWS
from pagoda.pagedkernel.quant.formats import OWN_TYPES, REPACKED_TYPES
from pagoda.pagedkernel.quant.testing import (
    float32_error_bound,
    float32_typical_error,
    int8_error_bound,
    random_weight,
)
from pagoda.pagedkernel.testing import c_kernel_or_skip
from pagoda.server.cli import main
from pagoda.server.llm import LLM
from pagoda.server.loader import LoadedModel, load_model
from pagoda.server.models.base import DecoderLM
from pagoda.server.models.layers import Linear, QuantizableWeight
from pagoda.server.models.llama import LlamaForCausalLM
from pagoda.server.models.quantized import QuantizedWeight, resident_weight_bytes
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import PagedKV, dense_copy
from pagoda.server.testing.tiny_gguf import write_tiny_gguf
from torch import Tensor
from transformers import AutoModelForCausalLM

CPU = torch.device("cpu")
TYPES = [t.name for t in GGMLType if t not in OWN_TYPES | REPACKED_TYPES]  # the types a GGUF file can hold
PROMPT = [
    1,
    40,
    41,
    300,
    12,
    99,
    5,
    60,
    61,
    7,
    250,
    33,
    17,
    80,
    81,
    9,
    3,
    120,
    44,
    45,
]  # 20 tokens: > 16 rows
# The int8-activation matmul moves each activation by at most half a step of max|block| / 127: about 0.5% rms of
# each product for Gaussian-like inputs (measured 0.4-1.1% per layer of these files). Each decoder layer feeds four
# quantized inputs (qkv, o, gate/up, down), the LM head one more, and every decode step also reads the K/V that
# earlier (perturbed) steps wrote: measured 1.6-6.3% after four steps on the tiny Llama, so the bound on the
# logits' error relative to their 2-norm is 10%, while each layer is held to the kernel's exact bound.
INT8_LOGIT_BOUND = 0.10


@pytest.fixture
def gguf_files(mixed_gguf: MixedGGUFs) -> Callable[[str, str], Path]:
    """`gguf_files(arch, types)`: a tiny GGUF of `arch` with every matrix of one type, or "mix" (every type, the
    embedding Q8_0 as in the default model)."""

    def get(arch: str, types: str) -> Path:
        return mixed_gguf(arch, TYPES) if types == "mix" else mixed_gguf(arch, (types,), types)

    return get


def load(path: Path, cache: Path, *, keep: bool, backend: QuantBackendName = "torch") -> LoadedModel:
    """The tiny GGUF model, quantized (`keep`) or dequantized, in float32."""
    return load_model(
        str(path),
        dtype=torch.float32,
        device=CPU,
        cache_dir=cache,
        keep_quantized=keep,
        quant_backend=backend,
    )


def quantized_types(loaded: LoadedModel) -> set[str]:
    """The block types the loaded model's layers hold."""
    return types_held(loaded.model)


def types_held(model: torch.nn.Module) -> set[str]:
    """The block types a model's layers hold."""
    return {
        part.qtype.name
        for module in model.modules()
        if isinstance(module, QuantizableWeight) and module.quantized is not None
        for part in module.quantized.parts
    }


def decode_logits(loaded: LoadedModel, backend: KernelBackend, steps: int = 4) -> list[Tensor]:
    """Logits of a 20-token prefill, then of `steps` one-token decode steps of two sequences (two rows)."""
    kv = PagedKV(loaded.model.kv_cache_spec(), backend)
    out: list[Tensor] = []
    with torch.no_grad():
        first = kv.run(loaded.model, [(0, PROMPT), (1, PROMPT[:17])])
        out.append(first)
        tokens = first.argmax(-1).tolist()
        for _ in range(steps):
            logits = kv.run(loaded.model, [(0, [tokens[0]]), (1, [tokens[1]])])
            out.append(logits)
            tokens = logits.argmax(-1).tolist()
    return out


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("qtype", TYPES)
def test_each_type_runs_quantized_and_equals_the_dequantized_model(
    arch: str,
    qtype: str,
    gguf_files: Callable[[str, str], Path],
    tmp_path: Path,
    torch_backend: KernelBackend,
) -> None:
    """Every matrix held as `qtype` blocks (the tied Gemma embedding too): the torch ops' logits equal the dense
    float32 model's, prefill and decode, and the weights take about the file's bytes."""
    path = gguf_files(arch, qtype)
    quantized = load(path, tmp_path, keep=True)
    dense = load(path, tmp_path, keep=False)
    assert quantized_types(quantized) == {qtype}
    assert quantized_types(dense) == set()
    for got, want in zip(
        decode_logits(quantized, torch_backend), decode_logits(dense, torch_backend), strict=True
    ):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    file_bytes = gguf_tensor_bytes(path)
    assert resident_weight_bytes(quantized.model) <= 1.15 * file_bytes
    assert resident_weight_bytes(dense.model) > 2 * file_bytes  # float32: what quantized layers avoid


def gguf_tensor_bytes(path: Path) -> int:
    """The bytes of a GGUF file's tensors."""
    from gguf import GGUFReader

    return sum(int(tensor.n_bytes) for tensor in GGUFReader(str(path)).tensors)


def check_each_layer(model: torch.nn.Module, checked: list[int]) -> list[torch.utils.hooks.RemovableHandle]:
    """Hooks asserting each quantized linear layer's output against the exact (torch-op) product of the same
    input: within `int8_error_bound` for <= GEMV_MAX_ROWS rows, within float32 rounding of the exact product above
    (the exact weights multiplied in float32): every element within twice the worst case, and the typical error
    within twice its expected size (`float32_typical_error` <= 2: two float32 evaluations, each within u sqrt(K)
    of the products' RMS size; the file's weights are random with zero mean, so the products are uncorrelated
    whatever the activations)."""

    def hook(module: torch.nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        assert isinstance(module, Linear) and module.quantized is not None
        x = inputs[0].reshape(-1, inputs[0].shape[-1])  # [rows, K]
        exact = QuantizedWeight(module.quantized.parts, "torch").matmul(x)
        got = (
            output.reshape(exact.shape)
            if module.bias is None
            else (output - module.bias).reshape(exact.shape)
        )
        parts = module.quantized.parts
        weights = [dequantize(p) for p in parts]
        # a repacked layout takes int8 activations at any row count
        int8 = [x.shape[0] <= GEMV_MAX_ROWS or p.qtype in REPACKED_TYPES for p in parts]
        if not any(int8):
            typical = float32_typical_error(got, x, torch.cat(weights), reference=exact)
            assert typical <= 2.0, f"typical error {typical:.2f} x u sqrt(K)"
        # both sides of a float path are float32 evaluations of the same product: twice one's bound holds them
        bound = torch.cat(
            [
                int8_error_bound(x, w) if small else 2 * float32_error_bound(x, w)
                for w, small in zip(weights, int8, strict=True)
            ],
            dim=-1,
        )
        assert bool(((got - exact).abs().double() <= bound).all())
        checked[0] += 1

    return [
        m.register_forward_hook(hook)
        for m in model.modules()
        if isinstance(m, Linear) and m.quantized is not None
    ]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_int8_activation_decode_stays_within_the_logit_bound(
    arch: str, gguf_files: Callable[[str, str], Path], tmp_path: Path, torch_backend: KernelBackend
) -> None:
    """The `cpu` ops on a file of every type. Each layer: within the int8 matmul's own error bound of the exact
    product (per element, `int8_error_bound`), or float32-close where its rows take the exact tiles. The model:
    logits within INT8_LOGIT_BOUND of the dense model's, relative to their norm (prefill, whose LM head runs 2
    rows, and decode steps). Skipped only without a C compiler; a kernel that fails to compile fails it."""
    c_kernel_or_skip(cpu_quant.kernels)
    path = gguf_files(arch, "mix")
    quantized = load(path, tmp_path, keep=True, backend="cpu")
    dense = load(path, tmp_path, keep=False)
    held = quantized_types(quantized)
    if (
        cpu_quant.repacked_layout(GGMLType.Q8_0) is not None
    ):  # the Q8_0 vocabulary table laid out for this CPU
        assert "Q8_0_R16" in held
    assert {repack.SOURCE_OF.get(GGMLType[t], GGMLType[t]).name for t in held} == set(TYPES)
    checked = [0]
    handles = check_each_layer(quantized.model, checked)
    got = decode_logits(quantized, torch_backend)
    for handle in handles:
        handle.remove()
    assert checked[0] > 0
    for step_got, step_want in zip(got, decode_logits(dense, torch_backend), strict=True):
        error = (step_got - step_want).norm(dim=-1) / step_want.norm(dim=-1)
        assert float(error.max()) <= INT8_LOGIT_BOUND, error


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_engine_greedy_tokens_equal_the_dequantized_engine(
    arch: str, gguf_files: Callable[[str, str], Path], tmp_path: Path
) -> None:
    """`LLM(quantization="gguf")` gives the greedy tokens of `quantization="none"` on a
    file that mixes every supported type (fused q/k/v of different types included); the default (None) keeps
    the blocks, as `gguf` does."""
    path = gguf_files(arch, "mix")
    prompts: list[Sequence[int]] = [PROMPT, PROMPT[:5], [1, 9, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = {}
    held: dict[str | None, set[str]] = {}
    for mode in ("gguf", None, "none"):
        llm = LLM(
            str(path),
            quantization=mode,
            kernel_backend="torch",
            dtype="float32",
            block_size=4,
            num_kv_blocks=128,
            max_model_len=64,
            cache_dir=str(tmp_path),
        )
        outputs[mode] = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
        held[mode] = types_held(llm.engine.runner.model)
    assert held == {"gguf": set(TYPES), None: set(TYPES), "none": set()}
    assert outputs["gguf"] == outputs["none"]
    assert outputs[None] == outputs["none"]
    assert all(len(tokens) == 12 for tokens in outputs["gguf"])


def test_engine_on_auto_runs_the_quantized_ops_in_c(
    gguf_files: Callable[[str, str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default kernel backend (`auto`) on a CPU with a compiler runs an engine's quantized layers on the C
    kernels, as it runs attention on the cpu backend (test_engine's `backend.name == "cpu"`): `auto` falls back to
    torch with only a warning, so without this a kernel that stopped loading would leave every test green. A
    prefill (20 rows) and decode steps (1-3 rows) on a file of every type: the C wrappers ran, torch_quant never.
    Skipped only without a C compiler (a kernel that fails to compile fails it)."""
    c_kernel_or_skip(cpu_quant.kernels)
    cpu_quant.available.cache_clear()  # decided afresh for this engine, not by an earlier test's answer
    ran: Counter[str] = Counter()

    def spy(module: object, name: str) -> None:
        real = getattr(module, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            ran[f"{getattr(module, '__name__', '?').rsplit('.', 1)[-1]}.{name}"] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)

    for name in ("gemv", "vector", "tiled", "amx", "dequantize"):
        spy(cpu_quant, name)
    for name in ("qmatmul", "dequantize"):
        spy(torch_quant, name)
    llm = LLM(
        str(gguf_files("llama", "mix")),
        quantization="gguf",
        block_size=4,
        num_kv_blocks=128,
        max_model_len=64,
        cache_dir=str(tmp_path),
    )
    assert llm.engine.runner.backend.name == "cpu"
    weights = [
        module.quantized
        for module in llm.engine.runner.model.modules()
        if isinstance(module, QuantizableWeight) and module.quantized is not None
    ]
    assert weights and all(weight.backend == "auto" for weight in weights)
    # The module path's ops are the question here: the native decode layers and the fused LM head (their own
    # tests prove they ran, bitwise these ops) would take the decode steps' few rows past cpu_quant.gemv.
    model = llm.engine.runner.model
    assert isinstance(model, LlamaForCausalLM)
    model.native_decode.enabled = False
    model.fused_head.enabled = False
    ran.clear()  # what loading did is not the question: the steps' ops are
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([PROMPT, PROMPT[:5], [1, 9, 9]], params, use_tqdm=False)
    assert all(len(out.outputs[0].token_ids) == 6 for out in outputs)
    in_c = sum(count for name, count in ran.items() if name.startswith("cpu_quant."))
    in_torch = {name: count for name, count in ran.items() if name.startswith("torch_quant.")}
    assert in_c > 0 and not in_torch, dict(ran)
    assert ran["cpu_quant.gemv"] > 0  # the decode steps' few rows
    assert ran["cpu_quant.amx"] + ran["cpu_quant.vector"] + ran["cpu_quant.tiled"] > 0  # the prefill's many


def test_unsupported_type_is_dequantized_with_a_warning_naming_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, torch_backend: KernelBackend
) -> None:
    """A matrix of a GGUF type the quantized ops lack (MXFP4) is converted to float32 with a warning naming the
    tensor and its type; the others stay quantized and the model equals the dequantized one."""
    path, _ = write_tiny_gguf(
        "llama", tmp_path / "mxfp4.gguf", lambda name: "MXFP4" if name == "blk.0.ffn_up.weight" else "Q8_0"
    )
    with caplog.at_level(logging.WARNING, logger="pagoda.server.loader.quantized_cache"):
        quantized = load(path, tmp_path / "cache", keep=True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("blk.0.ffn_up.weight" in w and "MXFP4" in w for w in warnings), warnings
    layer = quantized.model.get_submodule("model.layers.0.mlp.gate_up_proj")
    assert isinstance(layer, QuantizableWeight) and layer.quantized is None  # up is float32, so gate is too
    assert quantized_types(quantized) == {"Q8_0"}
    dense = load(path, tmp_path / "cache", keep=False)
    for got, want in zip(
        decode_logits(quantized, torch_backend), decode_logits(dense, torch_backend), strict=True
    ):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_quantization_gguf_on_a_safetensors_folder_exits_2_naming_the_flag(
    tiny_model_path: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`--quantization gguf` needs a .gguf: a safetensors folder is refused before loading, naming the flag;
    `none` is accepted there (it is what such a folder loads as), and a bad value is refused by argparse."""
    folder = str(tiny_model_path("llama"))
    assert main(["serve", folder, "--quantization", "gguf"]) == 2
    assert "--quantization" in capsys.readouterr().err
    assert main(["serve", "model.gguf", "--quantization", "int8"]) == 2  # int8 quantizes safetensors only
    assert "--quantization" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["serve", folder, "--quantization", "awq"])
    assert info.value.code == 2
    with pytest.raises(ValueError, match="quantization"):
        LLM(folder, quantization="gguf")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_dense_copy_lets_transformers_load_the_quantized_cache(
    arch: str, gguf_files: Callable[[str, str], Path], tmp_path: Path
) -> None:
    """transformers cannot read a cache that keeps block formats; `dense_copy` makes a float32 folder it loads
    without a mismatched size, whose greedy tokens are the engine's over the kept blocks (torch ops)."""
    llm = LLM(
        str(gguf_files(arch, "Q8_0")),
        quantization="gguf",
        kernel_backend="torch",
        dtype="float32",
        block_size=4,
        num_kv_blocks=64,
        max_model_len=64,
        cache_dir=str(tmp_path / "cache"),
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = llm.generate([list(PROMPT)], params, use_tqdm=False)[0].outputs[0].token_ids
    folder = llm.engine.model_path
    copy = dense_copy(folder, tmp_path / "dense")
    assert copy != folder and dense_copy(copy, tmp_path / "again") == copy  # a plain folder is its own copy
    hf = cast(Any, AutoModelForCausalLM.from_pretrained(copy, dtype=torch.float32))
    ids = torch.tensor([list(PROMPT)])
    want = hf.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)[0, ids.shape[1] :].tolist()
    assert list(got) == want


@pytest.mark.parametrize("rows", [1, GEMV_MAX_ROWS + 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_runs_of_rows_of_different_types_write_their_own_columns(
    rows: int, dtype: torch.dtype, backend: QuantBackendName
) -> None:
    """A weight held as runs of rows in several types (as q/k/v of mixed types are) gives each run's product in its
    own columns of one output: equal to the products of the runs apart, side by side."""
    g = torch.Generator().manual_seed(rows)
    parts = [
        random_weight(GGMLType.Q8_0, (7, 256), g),
        random_weight(GGMLType.Q4_K, (5, 256), g),
        random_weight(GGMLType.Q6_K, (9, 256), g),
    ]
    weight = QuantizedWeight.of(parts, backend)
    assert len(weight.parts) == 3 and weight.shape == (21, 256)
    x = torch.randn(2, rows, 256, generator=g).to(dtype)
    got = weight.matmul(x)
    flat = x.reshape(-1, 256)
    want = torch.cat([QuantizedWeight.of([p], backend).matmul(flat) for p in parts], dim=-1)
    assert got.shape == (2, rows, 21) and got.dtype == dtype
    assert torch.equal(got.reshape(-1, 21), want)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("forced", [False, True], ids=["as-this-cpu-prefers", "forced"])
def test_the_vocabulary_table_is_repacked_for_the_cpu_kernel(
    arch: str,
    forced: bool,
    gguf_files: Callable[[str, str], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the `cpu` backend of a build that prefers it (`cpu_quant.repacked_layout`: AVX-512 VNNI or AVX2;
    `forced` makes every build take it, the plain C kernel on others), a Q8_0 vocabulary table (llama's LM head and embedding,
    Gemma 3's tied one) is held as Q8_0_R16: the file's bytes repacked, the embedding's rows looked up as before,
    the logits those of the int8 kernel on that layout; so are the layers whose rows are whole tiles of 16 (not on
    a build with AMX, whose bfloat16 tiles take their prompts). The torch backend keeps the file's format. Skipped
    only without a C compiler."""
    c_kernel_or_skip(cpu_quant.kernels)
    if forced:
        monkeypatch.setattr(cpu_quant, "repacked_layout", lambda q, prompts=False: repack.LAYOUT_OF.get(q))
    want = cpu_quant.repacked_layout(GGMLType.Q8_0) or GGMLType.Q8_0
    path = gguf_files(arch, "Q8_0")
    on_cpu = load(path, tmp_path, keep=True, backend="cpu").model
    on_torch = load(path, tmp_path, keep=True, backend="torch").model
    assert isinstance(on_cpu, DecoderLM) and isinstance(on_torch, DecoderLM)
    assert types_held(on_torch) == {"Q8_0"}
    vocabulary = {"model.embed_tokens", "lm_head"}
    for name, module in on_cpu.named_modules():
        if not isinstance(module, QuantizableWeight) or module.quantized is None:
            continue
        (part,) = module.quantized.parts if name in vocabulary else module.quantized.parts[:1]
        whole_tiles = name in vocabulary or part.shape[0] % 16 == 0  # a layer's run only in whole tiles
        layer_want = cpu_quant.repacked_layout(GGMLType.Q8_0, prompts=True) or GGMLType.Q8_0
        assert part.qtype is (want if name in vocabulary else layer_want if whole_tiles else GGMLType.Q8_0), (
            name
        )
        if name in vocabulary:
            source = on_torch.get_submodule(name)
            assert isinstance(source, QuantizableWeight) and source.quantized is not None
            rows_back = repack.unpack(part) if part.qtype is GGMLType.Q8_0_R16 else part
            assert torch.equal(rows_back.data, source.quantized.parts[0].data), name
    head = on_cpu.head().quantized
    assert head is not None
    ids = torch.tensor([0, 7, head.shape[0] - 1, 3])
    torch_head = on_torch.head().quantized
    assert torch_head is not None
    assert torch.equal(head.rows(ids, torch.float32), torch_head.rows(ids, torch.float32))
    hidden = torch.randn(3, head.shape[1], generator=torch.Generator().manual_seed(0))
    expected = qmatmul(hidden, head.parts[0], backend="cpu")  # the layout's own kernel
    if want is GGMLType.Q8_0_R16:
        assert torch.equal(expected, qmatmul(hidden, repack.repack(torch_head.parts[0]), backend="cpu"))
    assert torch.equal(on_cpu.head().scores(hidden)[:, : head.shape[0]], expected)
