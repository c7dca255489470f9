"""Issue 26 (embeddings): `LLM(runner="pooling").embed` against transformers' final hidden states, pooled the
same way, on every tiny architecture; through the same scheduler and paged KV (chunked prefill, batching, prefix
caching where exact, KV freed at once)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast
from unittest import mock

import pytest
import torch
from pagoda.server.llm import LLM
from pagoda.server.pooling import PoolingParams, PoolingType
from pagoda.server.pooling.pooler import Pooler
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import ARCHS
from transformers import AutoModelForCausalLM

VOCAB = 300  # token ids drawn below the tiny vocabulary
COSINE = 0.99999


def reference(model_dir: Path, prompts: Sequence[Sequence[int]], kind: PoolingType) -> list[torch.Tensor]:
    """transformers' float32 base-model `last_hidden_state` (final norm applied) of each prompt, pooled and
    L2-normalised."""
    model = cast(Any, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    vectors = []
    with torch.no_grad():
        for prompt in prompts:
            hidden = model.model(torch.tensor([list(prompt)])).last_hidden_state[0]  # [len, hidden]
            pooled = {"LAST": hidden[-1], "CLS": hidden[0], "MEAN": hidden.mean(dim=0)}[kind]
            vectors.append(torch.nn.functional.normalize(pooled, dim=0))
    return vectors


def prompts_of(count: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    """`count` random prompts of lo..hi tokens; a shared 24-token prefix on every other one (prefix-cache hits)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(24)]
    out = []
    for i in range(count):
        tail = [rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))]
        out.append(prefix + tail if i % 2 else tail)
    return out


def embed_llm(model_dir: Path, kind: PoolingType, *, prefix_caching: bool, budget: int = 16) -> LLM:
    """A float32 pooling LLM with small chunks (a `budget`-token step: longer prompts are prefilled in chunks)."""
    return LLM(
        str(model_dir),
        runner="pooling",
        pooler_config={"pooling_type": kind},
        dtype="float32",
        kernel_backend="torch",
        block_size=4,
        max_num_batched_tokens=budget,
        max_model_len=128,
        enable_prefix_caching=prefix_caching,
        kv_cache_gib=0.01,
    )


def assert_close(got: Sequence[Sequence[float]], want: Sequence[torch.Tensor]) -> None:
    """Each vector's cosine with its reference is at least COSINE, and each is a unit vector."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        vector = torch.tensor(g, dtype=torch.float32)
        cosine = torch.nn.functional.cosine_similarity(vector, w, dim=0).item()
        assert cosine >= COSINE, f"input {i}: cosine {cosine}"
        assert abs(vector.norm().item() - 1.0) < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_last_pooling_matches_transformers(
    tiny_model_path: Callable[[str], Path], arch: str, prefix_caching: bool
) -> None:
    """LAST (the default): single inputs and a 64-input batch, chunked prefill (inputs of up to 64 tokens in a
    32-token step), prefix caching on and off; a second pass over the same batch is served by the prefix cache (when
    on) and gives the same vectors."""
    model_dir = tiny_model_path(arch)
    llm = embed_llm(model_dir, "LAST", prefix_caching=prefix_caching, budget=32)
    batch = prompts_of(64, seed=1)
    want = reference(model_dir, batch, "LAST")
    single = [llm.embed(batch[i], use_tqdm=False)[0].outputs.embedding for i in (0, 1, 5)]
    assert_close(single, [want[i] for i in (0, 1, 5)])
    first = llm.embed(batch, use_tqdm=False)
    assert_close([o.outputs.embedding for o in first], want)
    again = llm.embed(batch, use_tqdm=False)
    assert_close([o.outputs.embedding for o in again], want)
    cached = sum(o.num_cached_tokens for o in again)
    assert (cached > 0) == prefix_caching
    # Every block was freed when its request finished: nothing is left running or held.
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.stats().num_running == 0
    assert llm.engine.kv_manager.num_free_blocks() == llm.engine.kv_manager.num_blocks


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["MEAN", "CLS"])
def test_mean_and_cls_pooling_match_transformers(
    tiny_model_path: Callable[[str], Path], arch: str, kind: PoolingType
) -> None:
    """MEAN and CLS read every position (or the first): under chunked prefill with prefix caching on, the batch and
    its repeat give transformers' vectors, the repeat taking nothing from the prefix cache (which would skip them)."""
    model_dir = tiny_model_path(arch)
    llm = embed_llm(model_dir, kind, prefix_caching=True, budget=32)
    batch = prompts_of(64, seed=2)
    want = reference(model_dir, batch, kind)
    assert_close([llm.embed(batch[1], use_tqdm=False)[0].outputs.embedding], [want[1]])
    for _ in range(2):
        outputs = llm.embed(batch, use_tqdm=False)
        assert_close([o.outputs.embedding for o in outputs], want)
        assert all(o.num_cached_tokens == 0 for o in outputs)


def test_kv_freed_in_the_step_of_the_last_chunk(tiny_model_path: Callable[[str], Path]) -> None:
    """A pooling request finishes in the step that computes its last chunk: its snapshot carries the vector
    and its blocks are free by then (no decode step follows)."""
    llm = embed_llm(tiny_model_path("llama"), "LAST", prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1, pooling=PoolingParams())
    engine.add_request("a", list(range(1, 41)), params)  # 40 tokens: three 16-token chunks
    steps = 0
    finished = []
    while engine.has_unfinished_requests():
        steps += 1
        finished += [o for o in engine.step() if o.finished]
    assert steps == 3
    assert len(finished) == 1 and finished[0].embedding is not None
    assert finished[0].outputs == ()
    assert engine.kv_manager.num_free_blocks() == engine.kv_manager.num_blocks


def test_pooling_runner_never_runs_the_lm_head(tiny_model_path: Callable[[str], Path]) -> None:
    """The pooling runner takes hidden states only: no step computes a logits row (the LM head is the largest
    matmul of a step), its held rows come back zero wide, and a tied head gets no packed copy."""
    llm = embed_llm(tiny_model_path("gemma3"), "LAST", prefix_caching=False)
    model = llm.engine.executor.driver.model
    assert not model.computes_logits
    assert getattr(model, "packed_head", None) is None
    widths: list[int] = []
    execute = llm.engine.executor.execute

    def recording(*args: Any, **kwargs: Any) -> Any:
        logits, hidden = execute(*args, **kwargs)
        widths.append(logits.shape[1])
        return logits, hidden

    with (
        mock.patch.object(llm.engine.executor, "execute", recording),
        mock.patch.object(model, "compute_logits", side_effect=AssertionError("the LM head ran")),
    ):
        outputs = llm.embed(prompts_of(6, seed=3), use_tqdm=False)
    assert all(o.outputs.embedding for o in outputs)
    assert widths and set(widths) == {0}


def test_tensor_parallel_pooling_equals_one_rank(tiny_model_path: Callable[[str], Path]) -> None:
    """TP=2 embeds what TP=1 embeds: every rank skips the LM head alike (its vocabulary gather is a collective),
    so the steps neither hang nor differ."""
    model_dir = tiny_model_path("gemma3")
    batch = prompts_of(6, seed=4)
    want = [
        o.outputs.embedding
        for o in embed_llm(model_dir, "LAST", prefix_caching=False).embed(batch, use_tqdm=False)
    ]
    tp2 = LLM(
        str(model_dir),
        runner="pooling",
        dtype="float32",
        kernel_backend="torch",
        block_size=4,
        max_num_batched_tokens=16,
        max_model_len=128,
        kv_cache_gib=0.01,
        tensor_parallel_size=2,
    )
    try:
        got = [o.outputs.embedding for o in tp2.embed(batch, use_tqdm=False)]
    finally:
        tp2.engine.close()
    assert_close(got, [torch.tensor(w, dtype=torch.float32) for w in want])


def test_preempted_mean_request_counts_no_position_twice() -> None:
    """The pooler skips positions it already took (a recomputation after preemption re-sends them)."""
    pooler = Pooler(PoolingParams(pooling_type="MEAN", normalize=False), 6)
    rows = torch.arange(12, dtype=torch.float32).reshape(6, 2)  # [6, 2]
    pooler.add(0, rows[:4])
    pooler.add(0, rows[:3])  # recomputed from the start
    pooler.add(3, rows[3:])
    assert torch.equal(pooler.result(), rows.mean(dim=0))


def test_matryoshka_dimensions_cut_before_normalising() -> None:
    """`dimensions` keeps the first values, then normalises (vLLM's order)."""
    pooler = Pooler(PoolingParams(dimensions=2, pooling_type="LAST", normalize=True), 2)
    pooler.add(0, torch.tensor([[9.0, 9.0, 9.0], [3.0, 4.0, 100.0]]))
    assert torch.allclose(pooler.result(), torch.tensor([0.6, 0.8]))


def test_runner_mismatch_is_rejected_naming_the_runner(tiny_model_path: Callable[[str], Path]) -> None:
    """A generate request to the pooling runner, an embedding to the generate runner, and dimensions on a model
    without Matryoshka dimensions are rejected with the runner to start (or the field)."""
    from pagoda.server.engine.admission import RequestRejectedError

    model_dir = tiny_model_path("llama")
    pooling = embed_llm(model_dir, "LAST", prefix_caching=False)
    with pytest.raises(RequestRejectedError, match="--runner generate"):
        pooling.generate([1, 2, 3], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(RequestRejectedError, match="Matryoshka") as info:
        pooling.embed([1, 2, 3], dimensions=4, use_tqdm=False)
    assert info.value.param == "dimensions"
    generate = LLM(
        str(model_dir), dtype="float32", kernel_backend="torch", kv_cache_gib=0.01, max_model_len=64
    )
    with pytest.raises(RequestRejectedError, match="--runner pooling"):
        generate.embed([1, 2, 3], use_tqdm=False)


def test_embedding_crosses_the_core_frames() -> None:
    """An engine core's delta of a finished pooling snapshot carries the vector through msgpack to the front end."""
    import msgspec
    from pagoda.server.core.deltas import DeltaDecoder, DeltaEncoder
    from pagoda.server.core.messages import OutputDelta
    from pagoda.server.outputs import RequestMetrics, RequestOutput

    vector = (0.25, -0.5, 0.125)
    output = RequestOutput("r", None, (1, 2), (), True, RequestMetrics(0.0), embedding=vector)
    frame = msgspec.msgpack.encode(DeltaEncoder().encode(output))
    decoder = DeltaDecoder()
    decoder.add("r", None, (1, 2))
    rebuilt = decoder.decode(msgspec.msgpack.decode(frame, type=OutputDelta))
    assert rebuilt is not None and rebuilt.embedding == vector


def test_aborted_pooling_request_leaves_no_owner(tiny_model_path: Callable[[str], Path]) -> None:
    """Aborting a pooling request mid-prefill frees its blocks and the engine forgets its sequence."""
    llm = embed_llm(tiny_model_path("llama"), "MEAN", prefix_caching=False)
    engine = llm.engine
    engine.add_request("a", list(range(1, 41)), SamplingParams(max_tokens=1, pooling=PoolingParams()))
    engine.step()
    engine.abort_request("a")
    (final,) = engine.step()
    assert final.finished and final.embedding is None
    assert not engine.has_unfinished_requests() and not engine.owners.seqs
    assert engine.kv_manager.num_free_blocks() == engine.kv_manager.num_blocks
