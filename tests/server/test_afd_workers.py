"""Attention/FFN disaggregation on the CPU: the engine's process runs attention (with A > 1 its shard of the heads,
the other attention workers the rest), FFN workers (gloo, one torch thread each) run every MLP, two micro-batches
in ping-pong; greedy tokens equal the plain engine's, exactly.

Every engine is shut down by the `llms` fixture's teardown, so no FFN worker outlives its test.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from pagoda.server.afd_config import AttentionFFNConfig
from pagoda.server.cli import main
from pagoda.server.engine import EngineConfigError
from pagoda.server.engine.executor import ExecutorError
from pagoda.server.engine.executor.afd import AFDExecutor, check_gpus
from pagoda.server.engine.executor.afd_model import micro_batches
from pagoda.server.engine.executor.messages import RankSleepState
from pagoda.server.llm import LLM
from pagoda.server.lora import LoRARequest
from pagoda.server.models.attention import AttentionMetadata
from pagoda.server.models.quantized import resident_weight_bytes
from pagoda.server.procs import ProcessHandle
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import ARCHS, make_tiny_model
from pagoda.server.testing.compare import assert_same_logprobs
from pagoda.server.testing.tiny_lora import make_tiny_lora
from pagoda.server.testing.tiny_vlm import make_tiny_vlm
from test_engine import GREEDY, PREEMPTING_PROMPT_LENS, PROMPT_LENS, StepSpy, make_llm, random_prompts, tokens
from test_spec_engine import GREEDY as SPEC_GREEDY
from test_spec_engine import Oracle, assert_drafts_both_ways, draft_with, non_speculative, truths_of
from test_spec_engine import make_llm as make_spec_llm

AFD_ARGS: dict[str, Any] = {"attention_ffn_disaggregation": {"attention_workers": 1, "ffn_workers": 1}}
FLAG = "--attention-ffn-disaggregation"


def afd_args(attention: int, ffn: int) -> dict[str, Any]:
    """The LLM keyword of A attention ranks and F FFN ranks."""
    return {"attention_ffn_disaggregation": {"attention_workers": attention, "ffn_workers": ffn}}


LLMFactory = Callable[..., LLM]


@pytest.fixture(scope="module")
def afd_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny random-weight model folder per architecture (the Llama family and Gemma 3)."""
    root = tmp_path_factory.mktemp("afd-models")
    return {arch: make_tiny_model(arch, root / arch) for arch in ARCHS}


def afd_executor(llm: LLM) -> AFDExecutor:
    """The engine's AFD executor."""
    executor = llm.engine.executor
    assert isinstance(executor, AFDExecutor)
    return executor


def ffn_pid(llm: LLM) -> int:
    """The (one) FFN worker's process."""
    (worker,) = afd_executor(llm).workers
    assert isinstance(worker, ProcessHandle)
    return worker.pid


def greedy_tokens(
    llm: LLM, prompts: Sequence[Sequence[int]], params: SamplingParams = GREEDY
) -> list[list[int]]:
    """Sample 0's tokens of every prompt."""
    return tokens(llm.generate(prompts, params, use_tqdm=False))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ARCHS)
def test_afd_greedy_equals_plain(arch: str, afd_models: dict[str, Path], llms: LLMFactory) -> None:
    """A batch of prompts of different lengths: AFD gives the plain engine's tokens on every architecture; both
    micro-batches were at the FFN worker at once, which ran two micro-batches per forward of the decode steps."""
    prompts = random_prompts(PROMPT_LENS)
    want = greedy_tokens(llms(make_llm, afd_models[arch]), prompts)
    afd = llms(make_llm, afd_models[arch], **AFD_ARGS)
    assert greedy_tokens(afd, prompts) == want
    executor = afd_executor(afd)
    stats = executor.afd.stats
    assert stats.max_in_flight == 2
    # Five sequences decode together for 11 steps (the 12th token of each comes from the prompt's step).
    assert stats.by_micro_batches.get(2, 0) >= 11
    (counts,) = executor.ffn_counts()
    assert counts.forwards == stats.forwards and counts.micro_batches == stats.micro_batches
    assert counts.micro_batches > counts.forwards
    assert stats.exchange_seconds > 0 and counts.mlp_seconds > 0
    assert afd.engine.kv_manager.stats().num_used_blocks == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_two_ffn_workers_equal_plain(arch: str, afd_models: dict[str, Path], llms: LLMFactory) -> None:
    """Two FFN workers split every MLP (gate/up by rows, down by columns, all-reduced between them): the plain
    engine's tokens; each worker ran every micro-batch of every forward."""
    prompts = random_prompts(PROMPT_LENS)
    want = greedy_tokens(llms(make_llm, afd_models[arch]), prompts)
    afd = llms(
        make_llm, afd_models[arch], attention_ffn_disaggregation={"attention_workers": 1, "ffn_workers": 2}
    )
    assert greedy_tokens(afd, prompts) == want
    executor = afd_executor(afd)
    stats = executor.afd.stats
    assert stats.max_in_flight == 2
    counts = executor.ffn_counts()
    assert [c.rank for c in counts] == [1, 2]
    assert all(c.forwards == stats.forwards and c.micro_batches == stats.micro_batches for c in counts)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("arch", "ffn"), [("llama", 1), ("llama", 2), ("gemma3", 1), ("gemma3", 2), ("qwen3", 1)]
)
def test_two_attention_workers_equal_plain(
    arch: str, ffn: int, afd_models: dict[str, Path], llms: LLMFactory
) -> None:
    """Two attention ranks split every layer's heads and the KV cache (one of the two KV heads each, o_proj
    all-reduced between them) and exchange the MLPs with F FFN ranks: the plain engine's tokens, ping-pong
    included; every FFN worker ran every micro-batch."""
    prompts = random_prompts(PROMPT_LENS)
    plain = llms(make_llm, afd_models[arch])
    want = greedy_tokens(plain, prompts)
    afd = llms(make_llm, afd_models[arch], **afd_args(2, ffn))
    assert greedy_tokens(afd, prompts) == want
    executor = afd_executor(afd)
    assert [w.describe().split(" worker")[0] for w in executor.workers] == ["afd-attention"] + ["ffn"] * ffn
    whole = plain.engine.executor.driver.kv_cache.shape.num_kv_heads
    assert executor.driver.kv_cache.shape.num_kv_heads * 2 == whole
    stats = executor.afd.stats
    assert stats.max_in_flight == 2
    assert stats.by_micro_batches.get(2, 0) >= 11
    counts = executor.ffn_counts()
    assert [c.rank for c in counts] == list(range(2, 2 + ffn))
    assert all(c.forwards == stats.forwards and c.micro_batches == stats.micro_batches for c in counts)
    assert afd.engine.kv_manager.stats().num_used_blocks == 0


@pytest.mark.timeout(300)
def test_two_attention_workers_hold_twice_the_kv_blocks(
    afd_models: dict[str, Path], llms: LLMFactory
) -> None:
    """The KV pool sized from memory (`kv_cache_gib` per rank): a block of half the KV heads takes half the bytes,
    so two attention ranks hold twice the blocks of the plain engine (of A = 1) in the same memory each."""
    sized: dict[str, Any] = {"num_kv_blocks": None, "kv_cache_gib": 0.01}
    one = llms(make_llm, afd_models["llama"], **sized, **afd_args(1, 1)).engine.executor.num_blocks
    two = llms(make_llm, afd_models["llama"], **sized, **afd_args(2, 1)).engine.executor.num_blocks
    assert abs(two - 2 * one) <= 1


@pytest.mark.timeout(300)
def test_two_attention_workers_logprobs_match_plain(afd_models: dict[str, Path], llms: LLMFactory) -> None:
    """Sampled and prompt logprobs over two attention ranks: the LM head's vocabulary runs gathered to the driver
    (prompt logprobs through the executor's `compute_logits`), within float32 rounding of the plain engine's."""
    prompts = random_prompts((10, 7))
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    want = llms(make_llm, afd_models["gemma3"]).generate(prompts, params, use_tqdm=False)
    got = llms(make_llm, afd_models["gemma3"], **afd_args(2, 1)).generate(prompts, params, use_tqdm=False)
    assert_same_logprobs(want, got, max_tokens=4, tolerance=1e-4)


def test_attention_workers_the_heads_cannot_split_over_are_refused(afd_models: dict[str, Path]) -> None:
    """Three attention workers for four query heads: refused before any worker starts, naming the flag's key."""
    with pytest.raises(
        EngineConfigError, match=rf"{FLAG} attention_workers 3 must divide num_attention_heads \(4\)"
    ):
        make_llm(afd_models["llama"], **afd_args(3, 1))


def test_ffn_workers_the_mlp_cannot_split_over_are_refused(afd_models: dict[str, Path]) -> None:
    """Three FFN workers for four query heads: refused before any worker starts, naming the flag."""
    with pytest.raises(
        EngineConfigError, match=rf"{FLAG} ffn_workers 3 must divide num_attention_heads \(4\)"
    ):
        make_llm(afd_models["llama"], attention_ffn_disaggregation={"attention_workers": 1, "ffn_workers": 3})


def asleep(llm: LLM) -> bool:
    """engine.is_sleeping, read afresh (a call: mypy keeps no earlier assert's narrowing)."""
    return llm.engine.is_sleeping


def follower_states(llm: LLM) -> list[RankSleepState]:
    """What every worker said it holds after the engine's last sleep or wake, by rank."""
    sleeping = llm.engine.sleeping
    assert sleeping is not None
    states = list(sleeping.follower_states)
    assert all(isinstance(state, RankSleepState) for state in states)
    return cast(list[RankSleepState], states)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("arch", "attention", "ffn"), [("gemma3", 1, 1), ("llama", 2, 2)])
def test_afd_sleeps_and_wakes_with_the_plain_greedy_tokens(
    arch: str, attention: int, ffn: int, afd_models: dict[str, Path], llms: LLMFactory
) -> None:
    """Sleep mode with AFD: at level 1 and at level 2 the driver and every attention worker free their KV pools
    and release their weights, and every FFN worker its MLPs (each worker answers: no weight byte, no KV tensor);
    a wake (whole, or weights and then the KV pool) restores them all, and the greedy tokens before the first
    sleep and after every wake are the plain engine's."""
    prompts = random_prompts(PROMPT_LENS)
    want = greedy_tokens(llms(make_llm, afd_models[arch]), prompts)
    afd = llms(make_llm, afd_models[arch], enable_sleep_mode=True, **afd_args(attention, ffn))
    engine = afd.engine
    assert greedy_tokens(afd, prompts) == want
    driver_bytes = resident_weight_bytes(engine.runner.model)
    assert driver_bytes > 0
    workers = range(1, attention + ffn)
    holds_kv = [rank < attention for rank in workers]  # attention workers hold KV pools, FFN workers none
    awake: list[list[RankSleepState]] = []
    for level in (1, 2):
        afd.sleep(level)
        assert asleep(afd)
        assert resident_weight_bytes(engine.runner.model) == 0 and engine.runner.kv_cache.device_caches == []
        assert follower_states(afd) == [
            RankSleepState(rank, weight_bytes=0, kv_tensors=0) for rank in workers
        ]
        if level == 1:
            afd.wake_up()
        else:  # one part at a time: every worker follows each
            afd.wake_up(["weights"])
            assert all(s.weight_bytes > 0 and s.kv_tensors == 0 for s in follower_states(afd))
            afd.wake_up(["kv_cache"])
        assert not asleep(afd)
        assert resident_weight_bytes(engine.runner.model) == driver_bytes
        states = follower_states(afd)
        assert all(s.weight_bytes > 0 for s in states)
        assert [s.kv_tensors > 0 for s in states] == holds_kv
        awake.append(states)
        assert greedy_tokens(afd, prompts) == want, level
    assert awake[0] == awake[1]  # every worker's weights read back whole, both times


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("arch", "mode", "attention", "ffn"),
    [
        ("llama", "recompute", 1, 1),
        ("gemma3", "swap", 1, 1),
        ("llama", "swap", 2, 1),
        ("gemma3", "recompute", 2, 2),
    ],
)
def test_afd_preemption_is_exact(
    arch: str, mode: str, attention: int, ffn: int, afd_models: dict[str, Path], llms: LLMFactory
) -> None:
    """A pool too small for the batch preempts (recompute, or swap of the attention ranks' KV blocks: the FFN
    workers hold none; with two attention ranks each swaps its half of the heads)."""
    prompts = random_prompts(PREEMPTING_PROMPT_LENS, seed=1)
    args: dict[str, Any] = {"num_kv_blocks": 24, "max_model_len": 40, "preemption_mode": mode}
    want = greedy_tokens(llms(make_llm, afd_models[arch], swap_space_gib=0.01, **args), prompts)
    afd = llms(make_llm, afd_models[arch], swap_space_gib=0.01, **args, **afd_args(attention, ffn))
    spy = StepSpy(afd)
    assert greedy_tokens(afd, prompts) == want
    assert spy.swaps + spy.recomputes > 0
    assert (spy.swaps > 0) == (mode == "swap")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("arch", "attention", "ffn"),
    [("qwen3", 1, 1), ("gemma3", 1, 1), ("llama", 2, 2), ("gemma3", 2, 1), ("qwen3", 2, 1)],
)
def test_afd_prefix_caching_and_chunked_prefill_are_exact(
    arch: str, attention: int, ffn: int, afd_models: dict[str, Path], llms: LLMFactory
) -> None:
    """Prefix-cache hits and prefills split over steps (mixed with decodes: micro-batches of prefill chunks and
    decode rows) keep the plain engine's tokens; Gemma 3's sliding-window groups split with the batch (and with
    the heads, over two attention ranks)."""
    shared = random_prompts((24,), seed=2)[0]
    first = [shared + tail for tail in random_prompts((3, 5), seed=3)]
    second = [shared + tail for tail in random_prompts((4, 7, 2), seed=4)]
    args: dict[str, Any] = {"max_num_batched_tokens": 16}
    one = llms(make_llm, afd_models[arch], **args)
    afd = llms(make_llm, afd_models[arch], **args, **afd_args(attention, ffn))
    spy = StepSpy(afd)
    for batch in (first, second):
        assert greedy_tokens(afd, batch) == greedy_tokens(one, batch)
    assert spy.num_split_prefills > 0
    assert afd.engine.get_stats().prefix_cache_hits >= 3 * 24


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("attention", "ffn"), [(1, 1), (1, 2), (2, 2)])
def test_afd_with_adapters_equals_plain(
    attention: int, ffn: int, tmp_path: Path, afd_models: dict[str, Path], llms: LLMFactory
) -> None:
    """Three adapters in one batch with the base model: two on all of q/k/v/o/gate/up/down, one on the embedding,
    the LM head and the MLP's down_proj only. The attention ranks apply the attention parts, the FFN ranks (each its shard, with F = 2)
    the MLP parts with the step's per-row adapters: the plain engine's tokens, two micro-batches in ping-pong."""
    base = afd_models["llama"]
    every = [make_tiny_lora(base, tmp_path / f"all{i}", rank=4, seed=i) for i in (1, 2)]
    vocab_down = ("embed_tokens", "lm_head", "down_proj")  # the vocabulary hooks and one MLP projection
    down = make_tiny_lora(base, tmp_path / "down", rank=8, seed=3, target_modules=vocab_down)
    lora_args: dict[str, Any] = {"enable_lora": True, "max_loras": 3}
    # Two prompts of LONG_CHUNK or more: grouped rows per slot where the C LoRA op is absent.
    batch = random_prompts((9, 21, 7, 18, 6), seed=8)
    requests = [LoRARequest("all1", 1, str(every[0])), LoRARequest("all2", 2, str(every[1]))]
    loras = [requests[0], None, requests[1], LoRARequest("down", 3, str(down)), requests[0]]
    plain = llms(make_llm, base, **lora_args)
    want = tokens(plain.generate(batch, GREEDY, use_tqdm=False, lora_request=loras))
    base_tokens = tokens(plain.generate(batch, GREEDY, use_tqdm=False))
    # Every adapter counts: each adapted prompt's tokens differ from the base model's.
    assert all(w != b for w, b, lora in zip(want, base_tokens, loras, strict=True) if lora is not None)
    afd = llms(make_llm, base, **lora_args, **afd_args(attention, ffn))
    assert tokens(afd.generate(batch, GREEDY, use_tqdm=False, lora_request=loras)) == want
    # Two micro-batches in ping-pong, each under its own rows' adapters, here and at the FFN workers.
    executor = afd_executor(afd)
    assert executor.afd.stats.by_micro_batches.get(2, 0) >= 11 and executor.afd.stats.max_in_flight == 2
    assert all(c.micro_batches == executor.afd.stats.micro_batches for c in executor.ffn_counts())


@pytest.mark.timeout(300)
def test_killed_ffn_worker_fails_the_engine_fast(afd_models: dict[str, Path], llms: LLMFactory) -> None:
    """SIGKILL of the FFN worker mid-run: the next step raises ExecutorError naming the rank within seconds (its
    receives fail as its sockets close), and so does every later call of the executor; shutdown leaves no process."""
    afd = llms(make_llm, afd_models["llama"], **AFD_ARGS)
    engine = afd.engine
    for name, prompt in zip("ab", random_prompts((9, 5)), strict=True):
        engine.add_request(name, prompt, SamplingParams(temperature=0.0, max_tokens=50))
    engine.step()
    engine.step()
    pid = ffn_pid(afd)
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(ExecutorError, match=r"rank 1 \(pid \d+\) exited with -9"):
        for _ in range(50):
            engine.step()
    assert time.monotonic() - started < 30
    with pytest.raises(ExecutorError, match="rank 1"):
        engine.executor.compute_logits(torch.zeros(1, 64))
    engine.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.timeout(300)
def test_killed_attention_worker_fails_the_engine_fast(afd_models: dict[str, Path], llms: LLMFactory) -> None:
    """SIGKILL of the second attention rank mid-run (A = 2): the driver's next collective with it fails, and the
    step raises ExecutorError naming rank 1 within seconds; shutdown leaves no process (the FFN worker included)."""
    afd = llms(make_llm, afd_models["llama"], **afd_args(2, 1))
    engine = afd.engine
    for name, prompt in zip("ab", random_prompts((9, 5)), strict=True):
        engine.add_request(name, prompt, SamplingParams(temperature=0.0, max_tokens=50))
    engine.step()
    attention, ffn = afd_executor(afd).workers
    assert isinstance(attention, ProcessHandle) and isinstance(ffn, ProcessHandle)
    os.kill(attention.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(ExecutorError, match=r"rank 1 \(pid \d+\) exited with -9"):
        for _ in range(50):
            engine.step()
    assert time.monotonic() - started < 30
    engine.close()
    for pid in (attention.pid, ffn.pid):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"attention_workers": 0, "ffn_workers": 1}', "'attention_workers' must be an integer >= 1"),
        ('{"attention_workers": true, "ffn_workers": 1}', "'attention_workers' must be an integer >= 1"),
        ('{"attention_workers": 1, "ffn_workers": 0}', "'ffn_workers' must be an integer >= 1"),
        ('{"attention_workers": 1, "ffn": 1}', "unknown key"),
        ("[1, 1]", "must be a JSON object"),
        ("{", "not valid JSON"),
    ],
)
def test_bad_flag_values_exit_2(value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Bad JSON, bad counts and unknown keys exit 2 naming the flag."""
    with pytest.raises(SystemExit) as info:
        main(["serve", "unused-model", FLAG, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert FLAG in err and message in err


def test_tensor_parallel_with_afd_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    """AFD's ranks are its own: with --tensor-parallel-size 2 the config is refused, naming the flag."""
    flags = [FLAG, '{"attention_workers": 1, "ffn_workers": 1}', "--tensor-parallel-size", "2"]
    assert main(["serve", "unused-model", *flags]) == 2
    assert FLAG in capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            '{"attention_workers": 3, "ffn_workers": 1}',
            "attention_workers 3 must divide num_attention_heads (4)",
        ),
        ('{"attention_workers": 1, "ffn_workers": 3}', "ffn_workers 3 must divide num_attention_heads (4)"),
        ('{"attention_workers": 1, "ffn_workers": 5}', "ffn_workers 5 must divide num_attention_heads (4)"),
    ],
)
def test_workers_the_model_cannot_split_over_exit_2(
    value: str, message: str, afd_models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Counts the tiny model's four query heads cannot split over are a bad flag value, known from its config at
    launch: exit 2 naming the flag and the reason, before any weight loads or worker starts."""
    assert main(["serve", str(afd_models["llama"]), FLAG, value]) == 2
    err = capsys.readouterr().err
    assert f"pagoda serve: {FLAG} {message}" in err and "cannot start" not in err


def test_more_ranks_than_gpus_are_refused() -> None:
    """Local workers on CUDA take one GPU each (rank r on GPU r): A + F beyond the visible GPUs is a bad flag value,
    naming both counts and the GPUs; as many as are visible pass."""
    with pytest.raises(
        ValueError, match=rf"{FLAG} asks for 2 attention \+ 2 FFN ranks, one GPU each, but 3 GPU"
    ):
        check_gpus(AttentionFFNConfig(attention_workers=2, ffn_workers=2), 3)
    check_gpus(AttentionFFNConfig(attention_workers=2, ffn_workers=2), 4)


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="two GPUs would run this AFD engine")
def test_cuda_without_the_gpus_is_refused_before_any_worker_starts(afd_models: dict[str, Path]) -> None:
    """On CUDA with fewer visible GPUs than A + F (none here), LLM(...) refuses before any worker starts."""
    visible = torch.cuda.device_count()
    with pytest.raises(
        EngineConfigError, match=f"{FLAG} asks for 1 attention \\+ 1 FFN ranks.*but {visible} GPU"
    ):
        make_llm(afd_models["llama"], device="cuda", **AFD_ARGS)


def test_unsupported_model_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A model whose layers do not split here (a vision-language model) is a bad flag value at launch: exit 2
    naming the flag and the model class."""
    folder = make_tiny_vlm("llava", tmp_path / "vlm", small=True)
    assert main(["serve", str(folder), FLAG, '{"attention_workers": 1, "ffn_workers": 1}']) == 2
    err = capsys.readouterr().err
    assert f"{FLAG} runs the Llama family and Gemma 3 text models, not LlavaForConditionalGeneration" in err


def test_unsupported_model_is_refused(tmp_path: Path) -> None:
    """A model whose layers do not split here (a vision-language model) is refused naming the flag, before its
    engine serves anything."""
    folder = make_tiny_vlm("llava", tmp_path / "vlm", small=True)
    with pytest.raises(EngineConfigError, match=f"{FLAG} runs the Llama family and Gemma 3 text models"):
        make_llm(folder, **AFD_ARGS)


def test_micro_batches_cut_whole_sequences_of_about_equal_tokens() -> None:
    """Four sequences of 1, 1, 5 and 1 tokens: cutting after the second (2 vs 6 tokens) beats after the first
    (1 vs 7) and the third (7 vs 1); every field holds its sequences' own rows, the token offsets rebased."""
    starts = torch.tensor([0, 1, 2, 7, 8], dtype=torch.int32)
    attn = AttentionMetadata(
        slot_mapping=torch.arange(8),
        block_tables=torch.arange(8, dtype=torch.int32).view(4, 2),
        context_lens=torch.tensor([3, 4, 5, 6], dtype=torch.int32),
        query_start_loc=starts,
        max_query_len=5,
        is_decode=False,
        backend=None,  # type: ignore[arg-type]  # not read by the split
        group_slot_mappings=(torch.arange(8) + 100,),
        group_block_tables=(torch.arange(8, dtype=torch.int32).view(4, 2) + 10,),
    )
    (whole,) = micro_batches(attn, ping_pong=False)
    assert (whole.start, whole.end) == (0, 8) and whole.attn is attn
    first, second = micro_batches(attn, ping_pong=True)
    assert (first.start, first.end, second.start, second.end) == (0, 2, 2, 8)
    assert first.attn.query_start_loc.tolist() == [0, 1, 2] and second.attn.query_start_loc.tolist() == [
        0,
        5,
        6,
    ]
    assert (first.attn.max_query_len, second.attn.max_query_len) == (1, 5)
    assert second.attn.slot_mapping.tolist() == [2, 3, 4, 5, 6, 7]
    assert second.attn.block_tables.tolist() == [[4, 5], [6, 7]]
    assert second.attn.context_lens.tolist() == [5, 6]
    assert second.attn.group_slot_mappings[0].tolist() == [102, 103, 104, 105, 106, 107]
    assert second.attn.group_block_tables[0].tolist() == [[14, 15], [16, 17]]
    single = dataclasses.replace(attn, query_start_loc=torch.tensor([0, 8], dtype=torch.int32))
    assert len(micro_batches(single, ping_pong=True)) == 1


@pytest.mark.timeout(300)
def test_afd_drafted_greedy_equals_plain(afd_models: dict[str, Path]) -> None:
    """Speculative decoding under AFD: chunks of 1 + k drafted rows split into micro-batches like any others; the
    plain engine's tokens, with drafts both accepted and rejected."""
    model = afd_models["llama"]
    prompts = random_prompts((5, 9, 17), seed=30)
    expected = non_speculative(model, prompts, SPEC_GREEDY)
    llm = make_spec_llm(model, speculative_config={"method": "ngram"}, **AFD_ARGS)
    try:
        draft_with(llm, lambda: Oracle(truths_of(prompts, expected), error_rate=0.3, seed=31), k=4)
        assert greedy_tokens(llm, prompts, SPEC_GREEDY) == expected
        assert_drafts_both_ways(llm)
        assert afd_executor(llm).afd.stats.by_micro_batches.get(2, 0) > 0
    finally:
        llm.engine.close()
