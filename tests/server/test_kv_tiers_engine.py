"""The host KV tier in the engine (issue 39): a pool too small for the working set evicts prefixes, the tier gives
them back, and greedy tokens still equal transformers' float32 `generate` on every tiny architecture; the tier is
shared by two engines on one file and outlives an engine; salts never share."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from pagoda.server.engine import EngineConfigError
from pagoda.server.kv_tiers.extension import KVTierExtension
from pagoda.server.kv_tiers.offload import TieredOffload
from pagoda.server.llm import LLM
from pagoda.server.outputs import RequestOutput
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import ARCHS, make_tiny_model
from transformers import AutoModelForCausalLM, PreTrainedModel

BS = 4
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def prompts_of(lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths (ids clear of the special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every tiny architecture."""
    root = tmp_path_factory.mktemp("tier-models")
    return {arch: make_tiny_model(arch, root / arch) for arch in ARCHS}


def reference(model_dir: Path, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """transformers' float32 greedy generations, one prompt at a time."""
    model = cast(PreTrainedModel, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    out = []
    for prompt in prompts:
        ids = cast(Any, model).generate(
            torch.tensor([list(prompt)]),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
        out.append(ids[0, len(prompt) :].tolist())
    return out


def make_llm(model_dir: Path, num_blocks: int, **kwargs: Any) -> LLM:
    """float32, blocks of 4, a pool of `num_blocks` and a host tier of 8 MiB."""
    args: dict[str, Any] = {
        "block_size": BS,
        "num_kv_blocks": num_blocks,
        "max_model_len": 64,
        "dtype": "float32",
        "kv_offloading_size": 8 / 1024,
    }
    args.update(kwargs)
    return LLM(str(model_dir), **args)


def connector(llm: LLM) -> TieredOffload:
    """The engine's tier connector."""
    tiers = llm.engine.kv_tiers
    assert isinstance(tiers, KVTierExtension) and isinstance(tiers.connector, TieredOffload)
    return tiers.connector


def tokens(outputs: Sequence[RequestOutput]) -> list[list[int]]:
    """The generated ids of each output."""
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("arch", ARCHS)
def test_evicted_prefixes_come_back_from_the_host_tier(arch: str, model_dirs: dict[str, Path]) -> None:
    """Four 40-token prompts through a pool that holds about one: the second round hits the tier for every
    prompt's whole prefix, and every token equals the reference in both rounds."""
    prompts = prompts_of((41, 37, 43, 40), seed=1)
    expected = reference(model_dirs[arch], prompts)
    llm = make_llm(model_dirs[arch], num_blocks=20)
    try:
        first = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
        assert tokens(first) == expected
        hits_before = connector(llm).host_hits
        second = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
        assert tokens(second) == expected
        # Each prompt's full blocks (its last token is always computed) came back from somewhere.
        for out, prompt in zip(second, prompts, strict=True):
            assert out.num_cached_tokens == (len(prompt) - 1) // BS * BS
        assert connector(llm).host_hits > hits_before
        stats = connector(llm).stats()[0]
        assert stats.tier == "host" and stats.bytes_out > 0 and 0 < stats.used_bytes <= stats.capacity_bytes
    finally:
        llm.engine.close()


def test_preemption_with_the_tier_keeps_tokens(model_dirs: dict[str, Path]) -> None:
    """Six concurrent requests on a pool that cannot hold them, twice: preemption by recompute reloads from the
    tier and tokens equal the reference."""
    prompts = prompts_of((30, 33, 29, 35, 31, 34), seed=2)
    expected = reference(model_dirs["llama"], prompts)
    llm = make_llm(model_dirs["llama"], num_blocks=40, preemption_mode="recompute")
    try:
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        assert connector(llm).host_hits > 0
    finally:
        llm.engine.close()


def test_two_engines_share_one_host_tier_and_it_outlives_them(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Engine A computes a prompt; engine B on the same shared file gets its prefix as a hit; after both closed
    (neither owns the file), engine C still does."""
    shm = tmp_path / "tier"
    prompt = prompts_of((45,), seed=3)[0]
    expected = reference(model_dirs["qwen2"], [prompt])
    a = make_llm(model_dirs["qwen2"], num_blocks=64, kv_offloading_shm=str(shm))
    b = make_llm(model_dirs["qwen2"], num_blocks=64, kv_offloading_shm=str(shm))
    try:
        assert tokens(a.generate([prompt], GREEDY, use_tqdm=False)) == expected
        out = b.generate([prompt], GREEDY, use_tqdm=False)
        assert tokens(out) == expected and out[0].num_cached_tokens == 44
    finally:
        a.engine.close()
        b.engine.close()
    assert shm.exists()
    c = make_llm(model_dirs["qwen2"], num_blocks=64, kv_offloading_shm=str(shm))
    try:
        out = c.generate([prompt], GREEDY, use_tqdm=False)
        assert tokens(out) == expected and out[0].num_cached_tokens == 44
    finally:
        c.engine.close()


def test_salts_never_share_tier_blocks(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A prefix saved under one cache_salt is no hit under another, nor without one, in a second engine."""
    shm = tmp_path / "tier"
    prompt = prompts_of((41,), seed=4)[0]
    a = make_llm(model_dirs["llama"], num_blocks=64, kv_offloading_shm=str(shm))
    b = make_llm(model_dirs["llama"], num_blocks=64, kv_offloading_shm=str(shm))
    salted = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, cache_salt="tenant-a")
    try:
        a.generate([prompt], salted, use_tqdm=False)
        other = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, cache_salt="tenant-b")
        assert b.generate([prompt], other, use_tqdm=False)[0].num_cached_tokens == 0
        plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        assert b.generate([prompt], plain, use_tqdm=False)[0].num_cached_tokens == 0
        assert b.generate([prompt], salted, use_tqdm=False)[0].num_cached_tokens == 40
    finally:
        a.engine.close()
        b.engine.close()


def test_another_models_tier_is_refused(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A shared file made for another model's blocks is never read: the engine refuses to start on it."""
    shm = tmp_path / "tier"
    a = make_llm(model_dirs["llama"], num_blocks=64, kv_offloading_shm=str(shm))
    try:
        with pytest.raises(ValueError, match="another model"):
            make_llm(model_dirs["qwen3"], num_blocks=64, kv_offloading_shm=str(shm))
    finally:
        a.engine.close()


def test_the_private_tier_is_removed_at_close(model_dirs: dict[str, Path]) -> None:
    """Without a named file the engine makes its own and removes it when it closes."""
    llm = make_llm(model_dirs["llama"], num_blocks=64)
    path = connector(llm).host.path
    assert path.exists()
    llm.engine.close()
    assert not path.exists()


def test_tiers_refuse_what_they_cannot_serve(model_dirs: dict[str, Path]) -> None:
    """The contiguous manager has no prefix keys: refused naming the flag."""
    with pytest.raises((ValueError, EngineConfigError), match="kv_offloading_size"):
        make_llm(model_dirs["llama"], num_blocks=64, kv_manager="contiguous")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_host_tier_on_cuda(arch: str, model_dirs: dict[str, Path]) -> None:
    """On CUDA the tier's copies go through pinned staging on a side stream: the second round still hits the
    tier and keeps the tokens of the first (float32, eager)."""
    prompts = prompts_of((41, 37, 43, 40), seed=1)
    llm = make_llm(model_dirs[arch], num_blocks=20, device="cuda", enforce_eager=True)
    try:
        first = tokens([llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts])
        hits = connector(llm).host_hits
        second = tokens([llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts])
        assert second == first and connector(llm).host_hits > hits
        assert connector(llm).rows.stream is not None
    finally:
        llm.engine.close()


def disk_llm(model_dir: Path, folder: Path, **kwargs: Any) -> LLM:
    """An engine with a private host tier and a disk tier in `folder` (64 MiB)."""
    return make_llm(
        model_dir,
        num_blocks=20,
        kv_offloading_disk_path=str(folder),
        kv_offloading_disk_size=1 / 16,
        **kwargs,
    )


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3"])
def test_a_restart_serves_prefixes_from_the_disk_tier(
    arch: str, model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Engine A computes the prompts and closes (its queued writes finish); engine B, with a new and empty host
    tier on the same folder, reads every prompt's prefix from disk: full hits, the reference's tokens."""
    prompts = prompts_of((41, 37, 43), seed=5)
    expected = reference(model_dirs[arch], prompts)
    folder = tmp_path / "kv"
    a = disk_llm(model_dirs[arch], folder)
    try:
        assert tokens([a.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]) == expected
    finally:
        a.engine.close()
    assert any(folder.rglob("*")), "the disk tier wrote nothing"
    b = disk_llm(model_dirs[arch], folder)
    try:
        second = [b.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
        assert tokens(second) == expected
        assert [o.num_cached_tokens for o in second] == [(len(p) - 1) // BS * BS for p in prompts]
        assert connector(b).disk_hits > 0
    finally:
        b.engine.close()


def test_corrupt_block_files_are_recomputed_never_served(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Every block file with one byte flipped: the next engine finds no hit and still answers the reference."""
    prompt = prompts_of((41,), seed=6)[0]
    expected = reference(model_dirs["llama"], [prompt])
    folder = tmp_path / "kv"
    a = disk_llm(model_dirs["llama"], folder)
    a.generate([prompt], GREEDY, use_tqdm=False)
    a.engine.close()
    files = [f for f in folder.rglob("*") if f.is_file()]
    assert files
    for f in files:
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    b = disk_llm(model_dirs["llama"], folder)
    try:
        out = b.generate([prompt], GREEDY, use_tqdm=False)
        assert tokens(out) == expected and out[0].num_cached_tokens == 0
    finally:
        b.engine.close()


def test_salts_stay_apart_across_a_restart(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A prefix written to disk under one salt is no hit under another after a restart, and a hit under its own."""
    prompt = prompts_of((41,), seed=7)[0]
    folder = tmp_path / "kv"

    def salted(salt: str | None) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, cache_salt=salt)

    a = disk_llm(model_dirs["llama"], folder)
    a.generate([prompt], salted("tenant-a"), use_tqdm=False)
    a.engine.close()
    b = disk_llm(model_dirs["llama"], folder)
    try:
        assert b.generate([prompt], salted("tenant-b"), use_tqdm=False)[0].num_cached_tokens == 0
        assert b.generate([prompt], salted(None), use_tqdm=False)[0].num_cached_tokens == 0
        assert b.generate([prompt], salted("tenant-a"), use_tqdm=False)[0].num_cached_tokens == 40
    finally:
        b.engine.close()


def test_another_models_disk_blocks_are_misses(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """The same folder under another model: its files carry another identity and are never read as hits."""
    prompt = prompts_of((41,), seed=8)[0]
    folder = tmp_path / "kv"
    a = disk_llm(model_dirs["llama"], folder)
    a.generate([prompt], GREEDY, use_tqdm=False)
    a.engine.close()
    b = disk_llm(model_dirs["qwen2"], folder)
    try:
        out = b.generate([prompt], GREEDY, use_tqdm=False)
        assert out[0].num_cached_tokens == 0
        assert tokens(out) == reference(model_dirs["qwen2"], [prompt])
    finally:
        b.engine.close()
