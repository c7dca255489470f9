"""Tensor parallelism over a quantized GGUF: each rank reads only its slices of the blocks, the shards tile the
model, TP=2 gives TP=1's greedy tokens, and a row-parallel split off the block bounds is refused naming the tensor.

Column-parallel layers split whole rows of blocks; row-parallel layers (o_proj, down_proj) split each row's
blocks, so a rank's columns must start and end on a block (32 elements, 256 for the K-quants).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pagoda.server.loader.weights as weights
import pytest
import torch
from pagoda.pagedkernel.quant import repack
from pagoda.pagedkernel.quant.formats import REPACKED_TYPES
from pagoda.server.llm import LLM
from pagoda.server.loader import WeightLoadError, load_model
from pagoda.server.models.layers import QuantizableWeight
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing.tiny_gguf import write_tiny_gguf
from test_tensor_parallel import RankOf

CPU = torch.device("cpu")
# o_proj's 256 columns split into 2 x 128: a block-32 type; down_proj's 512 into 2 x 256: a K-quant fits.
SPLITTABLE = {
    "attn_q": "Q6_K",
    "attn_k": "Q4_K",
    "attn_v": "Q8_0",
    "attn_output": "Q5_0",
    "ffn_gate": "Q5_K",
    "ffn_up": "Q4_1",
    "ffn_down": "Q4_K",
    "output": "Q6_K",
    "token_embd": "Q8_0",
}


def splittable_type(name: str) -> str:
    """The SPLITTABLE type of a GGUF tensor name ("blk.0.attn_q.weight" -> Q6_K)."""
    return SPLITTABLE[name.split(".")[-2]]


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny quantized Llama whose every layer splits over two ranks on block bounds."""
    root = tmp_path_factory.mktemp("quant-tp")
    return write_tiny_gguf("llama", root / "tp.gguf", splittable_type)[0]


@pytest.fixture
def llms() -> Iterator[list[LLM]]:
    """A list to put LLMs in; each is shut down (its workers stopped) after the test."""
    built: list[LLM] = []
    yield built
    for llm in built:
        llm.engine.close()


def blocks_of(model: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
    """Each quantized layer's runs of uint8 rows, by module name (a repacked vocabulary table read back as its
    rows: a shard's last tile differs from the whole table's)."""
    return {
        name: [
            (repack.unpack(part) if part.qtype in REPACKED_TYPES else part).data
            for part in module.quantized.parts
        ]
        for name, module in model.named_modules()
        if isinstance(module, QuantizableWeight) and module.quantized is not None
    }


def test_quantized_shards_load_slice_by_slice_and_tile_the_model(
    quantized_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rank reads only slices of the quantized matrices (whole reads are the norms), and the two ranks'
    blocks put back together (rows for column-parallel layers, each row's bytes for row-parallel ones) are the
    whole model's blocks."""
    full = blocks_of(
        load_model(str(quantized_gguf), dtype=torch.float32, device=CPU, cache_dir=tmp_path).model
    )
    whole_reads: list[str] = []
    get = weights._Checkpoint.get

    def spy(self: weights._Checkpoint, name: str) -> torch.Tensor:
        whole_reads.append(name)
        return get(self, name)

    monkeypatch.setattr(weights._Checkpoint, "get", spy)
    shards = [
        blocks_of(
            load_model(
                str(quantized_gguf), dtype=torch.float32, device=CPU, cache_dir=tmp_path, group=RankOf(r, 2)
            ).model
        )
        for r in range(2)
    ]
    assert whole_reads and all(name.endswith("norm.weight") for name in whole_reads), whole_reads
    assert set(full) == set(shards[0]) == set(shards[1])
    for name, whole in full.items():
        parts = [shard[name] for shard in shards]
        if name.endswith(("o_proj", "down_proj")):
            (left,), (right,) = parts
            assert torch.equal(torch.cat((left, right), dim=1), whole[0])
        elif name.endswith("qkv_proj"):
            # q of Q6_K, k of Q4_K, v of Q8_0: each rank holds 2 of 4 query heads and 1 of 2 KV heads of each.
            for index, run in enumerate(whole):
                rows = run.shape[0] // 2
                assert torch.equal(parts[0][index], run[:rows]) and torch.equal(parts[1][index], run[rows:])
        elif name.endswith("gate_up_proj"):
            for index, run in enumerate(whole):
                rows = run.shape[0] // 2
                assert torch.equal(parts[0][index], run[:rows]) and torch.equal(parts[1][index], run[rows:])
        else:  # the vocabulary runs: 400 = 200 + 200
            assert torch.equal(torch.cat([p[0] for p in parts]), whole[0]), name


@pytest.mark.timeout(300)
def test_tp2_greedy_equals_tp1_on_a_quantized_gguf(
    quantized_gguf: Path, tmp_path: Path, llms: list[LLM]
) -> None:
    """TP=2 over the quantized blocks gives TP=1's greedy tokens (both with the exact torch quantized ops)."""
    args = {"block_size": 4, "num_kv_blocks": 128, "max_model_len": 64, "dtype": "float32"}
    args.update(kernel_backend="torch", cache_dir=str(tmp_path))
    prompts = [[1, 40, 41, 300, 12, 99], [1, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    results = []
    for size in (1, 2):
        llm = LLM(str(quantized_gguf), tensor_parallel_size=size, **args)
        llms.append(llm)
        results.append([out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)])
    assert results[0] == results[1]
    assert all(len(tokens) == 10 for tokens in results[0])


def test_row_parallel_split_off_the_block_bounds_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    """o_proj as Q4_K (blocks of 256) cannot give each of two ranks 128 of its 256 columns: the load says which
    tensor, its type and the columns; with --quantization none the same file loads on two ranks."""
    path, _ = write_tiny_gguf(
        "llama",
        tmp_path / "q4k.gguf",
        lambda name: "Q4_K" if "attn_output" in name else splittable_type(name),
    )
    with pytest.raises(
        WeightLoadError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight: Q4_K .* blocks of 256"
    ):
        load_model(str(path), dtype=torch.float32, device=CPU, cache_dir=tmp_path, group=RankOf(0, 2))
    dense = load_model(
        str(path),
        dtype=torch.float32,
        device=CPU,
        cache_dir=tmp_path,
        group=RankOf(1, 2),
        keep_quantized=False,
    ).model
    whole = load_model(
        str(path), dtype=torch.float32, device=CPU, cache_dir=tmp_path, keep_quantized=False
    ).model
    assert not blocks_of(dense)
    name = "model.layers.0.self_attn.o_proj.weight"
    got, want = dense.get_parameter(name), whole.get_parameter(name)
    assert torch.equal(got, want[:, 128:])  # rank 1's columns, cut from the dequantized rows
