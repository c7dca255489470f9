"""Tensor parallelism on the CPU: two ranks (gloo, one torch thread each) give TP=1's greedy tokens, exactly.

Each TP=2 engine starts one worker process; every test shuts its engines down (a fixture's teardown), so no
worker outlives its test.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pagoda.server.loader.weights as weights
import pytest
import ray
import torch
from pagoda.server.async_llm import AsyncLLM
from pagoda.server.config import ServingConfig
from pagoda.server.engine import EngineConfigError
from pagoda.server.engine.executor import ExecutorError
from pagoda.server.engine.executor.distributed import DistributedExecutor
from pagoda.server.llm import LLM
from pagoda.server.loader import load_model
from pagoda.server.procs import ProcessHandle, ProcessLauncher
from pagoda.server.procs.ray_launcher import RayLauncher
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import ARCHS, make_tiny_model, tiny_config
from pagoda.server.testing.compare import assert_same_logprobs
from test_api_live import greedy, metric, serving, sync_client
from test_engine import (
    GREEDY,
    PREEMPTING_PROMPT_LENS,
    PROMPT_LENS,
    StepSpy,
    make_llm,
    random_prompts,
    tokens,
)
from transformers import PreTrainedModel

# Every architecture, plus the head layouts that matter for the split: one KV head (replicated on both ranks,
# as in Gemma 3 270M), as many KV heads as query heads (split), and a vocabulary that two ranks split unevenly.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    **{arch: (arch, {}) for arch in ARCHS},
    "llama_kv1": ("llama", {"num_key_value_heads": 1}),
    "llama_kv4": ("llama", {"num_key_value_heads": 4}),
    "gemma3_kv1": ("gemma3", {"num_key_value_heads": 1}),
    "qwen2_odd_vocab": ("qwen2", {"vocab_size": 401}),
}
TP_ARGS: dict[str, Any] = {"tensor_parallel_size": 2}

LLMFactory = Callable[..., LLM]


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny random-weight model folder per variant."""
    root = tmp_path_factory.mktemp("tp-models")
    return {name: make_tiny_model(arch, root / name, **extra) for name, (arch, extra) in VARIANTS.items()}


def worker_pids(llm: LLM) -> list[int]:
    """The worker processes of a TP engine with the mp backend."""
    executor = llm.engine.executor
    assert isinstance(executor, DistributedExecutor) and isinstance(executor.launcher, ProcessLauncher)
    assert all(isinstance(worker, ProcessHandle) for worker in executor.workers)
    return [worker.pid for worker in executor.workers if isinstance(worker, ProcessHandle)]


def greedy_tokens(
    llm: LLM, prompts: Sequence[Sequence[int]], params: SamplingParams = GREEDY
) -> list[list[int]]:
    """Sample 0's tokens of every prompt."""
    return tokens(llm.generate(prompts, params, use_tqdm=False))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tp2_greedy_equals_tp1(variant: str, tp_models: dict[str, Path], llms: LLMFactory) -> None:
    """A batch of prompts of different lengths: TP=2 gives TP=1's tokens, on every architecture and head split."""
    prompts = random_prompts(PROMPT_LENS)
    want = greedy_tokens(llms(make_llm, tp_models[variant]), prompts)
    tp = llms(make_llm, tp_models[variant], **TP_ARGS)
    assert greedy_tokens(tp, prompts) == want
    executor = tp.engine.executor
    assert isinstance(executor, DistributedExecutor)
    assert executor.collective_seconds() > 0 and executor.group.calls > 0
    assert tp.engine.kv_manager.stats().num_used_blocks == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("variant", "mode"), [("llama_kv1", "recompute"), ("gemma3", "swap")])
def test_tp2_preemption_is_exact(
    variant: str, mode: str, tp_models: dict[str, Path], llms: LLMFactory
) -> None:
    """A pool too small for the batch preempts (recompute; swap moves each rank's shard of the blocks)."""
    prompts = random_prompts(PREEMPTING_PROMPT_LENS, seed=1)
    args: dict[str, Any] = {"num_kv_blocks": 24, "max_model_len": 40, "preemption_mode": mode}
    want = greedy_tokens(llms(make_llm, tp_models[variant], swap_space_gib=0.01, **args), prompts)
    tp = llms(make_llm, tp_models[variant], swap_space_gib=0.01, **args, **TP_ARGS)
    spy = StepSpy(tp)
    assert greedy_tokens(tp, prompts) == want
    assert spy.swaps + spy.recomputes > 0
    assert (spy.swaps > 0) == (mode == "swap")


@pytest.mark.timeout(300)
def test_tp2_prefix_caching_and_chunked_prefill_are_exact(
    tp_models: dict[str, Path], llms: LLMFactory
) -> None:
    """Prefix-cache hits (same block tables on both ranks) and prefills split over steps keep TP=1's tokens."""
    shared = random_prompts((24,), seed=2)[0]
    first = [shared + tail for tail in random_prompts((3, 5), seed=3)]
    second = [shared + tail for tail in random_prompts((4, 7, 2), seed=4)]
    args: dict[str, Any] = {"max_num_batched_tokens": 16}
    one = llms(make_llm, tp_models["qwen3"], **args)
    tp = llms(make_llm, tp_models["qwen3"], **args, **TP_ARGS)
    spy = StepSpy(tp)
    for batch in (first, second):
        assert greedy_tokens(tp, batch) == greedy_tokens(one, batch)
    assert spy.num_split_prefills > 0
    assert tp.engine.get_stats().prefix_cache_hits >= 3 * 24


@pytest.mark.timeout(300)
def test_tp2_logprobs_and_prompt_logprobs_match_tp1(tp_models: dict[str, Path], llms: LLMFactory) -> None:
    """Gathered logits give TP=1's logprobs; prompt logprobs run the split LM head through the executor."""
    prompts = random_prompts((10, 7))
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    want = llms(make_llm, tp_models["gemma3_kv1"]).generate(prompts, params, use_tqdm=False)
    got = llms(make_llm, tp_models["gemma3_kv1"], **TP_ARGS).generate(prompts, params, use_tqdm=False)
    assert_same_logprobs(want, got, max_tokens=4, tolerance=1e-4)


def test_tp_size_the_heads_cannot_split_is_refused(tp_models: dict[str, Path], tmp_path: Path) -> None:
    """Three ranks for four query heads, or two for three KV heads: refused before any worker starts (the config
    alone decides), naming the constraint."""
    with pytest.raises(
        EngineConfigError, match=r"tensor_parallel_size 3 must divide num_attention_heads \(4\)"
    ):
        make_llm(tp_models["llama"], tensor_parallel_size=3)
    tiny_config("qwen3", num_attention_heads=6, num_key_value_heads=3).save_pretrained(tmp_path)
    with pytest.raises(EngineConfigError, match=r"and num_key_value_heads \(3\) must divide one another"):
        make_llm(tmp_path, tensor_parallel_size=2)


@pytest.mark.timeout(300)
def test_tp2_from_a_gguf_file(
    tiny_gguf: tuple[Path, PreTrainedModel], gguf_cache: Path, llms: LLMFactory
) -> None:
    """A GGUF file is converted once, by the driver; both ranks load their shards from the cache."""
    gguf_path, _ = tiny_gguf
    prompts = random_prompts((6, 11))
    want = greedy_tokens(llms(make_llm, gguf_path), prompts)
    assert greedy_tokens(llms(make_llm, gguf_path, **TP_ARGS), prompts) == want
    assert len([p for p in gguf_cache.iterdir() if not p.name.startswith(".")]) == 1


@pytest.mark.timeout(300)
def test_killed_worker_fails_the_engine_fast(tp_models: dict[str, Path], llms: LLMFactory) -> None:
    """SIGKILL of the worker mid-run: the next step raises ExecutorError naming the rank, within seconds, and so
    does every later call of the executor; shutdown leaves no process."""
    tp = llms(make_llm, tp_models["llama"], **TP_ARGS)
    engine = tp.engine
    engine.add_request("a", random_prompts((9,))[0], SamplingParams(temperature=0.0, max_tokens=50))
    engine.step()
    engine.step()
    (pid,) = worker_pids(tp)
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
def test_worker_dying_while_idle_kills_the_async_engine(tp_models: dict[str, Path], llms: LLMFactory) -> None:
    """SIGKILL of the worker while no request runs: the AsyncLLM's idle health check notices it (so /health says
    503 before any request arrives), and the engine's check_health names the rank."""
    tp = llms(make_llm, tp_models["llama"], **TP_ARGS)
    engine = tp.engine
    engine.check_health()  # healthy: no error
    llm = AsyncLLM(engine, ServingConfig(served_model_name="tp"))

    async def main() -> None:
        llm.start()
        try:
            await asyncio.sleep(0.1)
            assert llm.is_alive
            (pid,) = worker_pids(tp)
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while llm.is_alive:
                assert time.monotonic() < deadline, "the dead worker went unnoticed"
                await asyncio.sleep(0.05)
        finally:
            await asyncio.to_thread(llm.shutdown)

    asyncio.run(main())
    with pytest.raises(ExecutorError, match=r"rank 1 \(pid \d+\) exited with -9"):
        engine.check_health()


@pytest.mark.timeout(300)
def test_shutdown_stops_the_workers(tp_models: dict[str, Path]) -> None:
    """An engine shut down leaves no worker behind, and a second shutdown is harmless."""
    tp = make_llm(tp_models["llama"], **TP_ARGS)
    pids = worker_pids(tp)
    assert greedy_tokens(tp, random_prompts((5,)))
    tp.engine.close()
    tp.engine.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert torch.get_num_threads() >= 1


def child_pids(pid: int) -> list[int]:
    """The direct children of a process (Linux /proc)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(child) for child in (task / "children").read_text().split()]
    return children


@pytest.mark.timeout(600)
def test_live_server_tp2_gives_tp1_text_and_fails_fast_when_its_worker_dies(
    tp_models: dict[str, Path],
) -> None:
    """`--tensor-parallel-size 2` through the official client: TP=1's greedy text. Then the worker is killed in
    the middle of a long request: the request ends with an OpenAI-shaped 503, /health says 503 too."""
    model = tp_models["llama"]
    prompts = ["The quick brown fox", "Hello world! How are you today?", "Tokens, blocks"]
    with serving(model, "--max-model-len", "256") as one:
        want = [greedy(sync_client(one), prompt, 16) for prompt in prompts]
    # "none": the engine stays dead (no rebuild by the default "restart"), which is what this test observes.
    tp_flags = ("--max-model-len", "256", "--tensor-parallel-size", "2", "--on-engine-failure", "none")
    with serving(model, *tp_flags) as tp:
        client = sync_client(tp)
        assert [greedy(client, prompt, 16) for prompt in prompts] == want
        (worker,) = child_pids(tp.process.pid)
        with ThreadPoolExecutor(1) as pool:
            long = pool.submit(greedy, client, "The capital of France", 230)
            deadline = time.monotonic() + 60
            while (
                metric(httpx.get(f"{tp.base_url}/metrics").text, "pagoda:generation_tokens_total")
                < 16 * 3 + 2
            ):
                assert time.monotonic() < deadline and not long.done()
                time.sleep(0.01)
            os.kill(worker, signal.SIGKILL)
            with pytest.raises(openai.APIStatusError) as failed:
                long.result(timeout=60)
        assert failed.value.status_code == 503
        assert isinstance(failed.value.body, dict) and "engine has stopped" in str(
            failed.value.body["message"]
        )
        assert httpx.get(f"{tp.base_url}/health").status_code == 503


@pytest.mark.timeout(600)
def test_ray_executor_tp2_equals_tp1(ray_cluster: str, tp_models: dict[str, Path], llms: LLMFactory) -> None:
    """`distributed_executor_backend="ray"`: the worker is a Ray actor in a placement group; TP=1's tokens."""
    prompts = random_prompts(PROMPT_LENS)
    want = greedy_tokens(llms(make_llm, tp_models["gemma3_kv1"]), prompts)
    tp = llms(make_llm, tp_models["gemma3_kv1"], distributed_executor_backend="ray", **TP_ARGS)
    executor = tp.engine.executor
    assert isinstance(executor, DistributedExecutor) and isinstance(executor.launcher, RayLauncher)
    assert greedy_tokens(tp, prompts) == want
    assert len(ray.util.placement_group_table()) == 1 and executor.failure() is None
    tp.engine.close()
    assert all(entry["state"] == "REMOVED" for entry in ray.util.placement_group_table().values())


@dataclass(frozen=True)
class RankOf:
    """One rank's view for building and loading a shard in this process (the collectives are never called)."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Unused by loading."""
        raise AssertionError("no collective while loading")

    gather_last_dim = broadcast = all_reduce


@pytest.mark.parametrize("variant", ["llama_kv1", "qwen2_odd_vocab"])
def test_shards_load_slice_by_slice_and_tile_the_model(
    variant: str, tp_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rank reads only its slices of the split tensors (whole reads are the replicated ones: norms, the
    row-parallel biases), and the two ranks' shards put back together are the whole model."""
    whole_reads: list[str] = []
    get = weights._Checkpoint.get

    def spy(self: weights._Checkpoint, name: str) -> torch.Tensor:
        whole_reads.append(name)
        return get(self, name)

    full = load_model(str(tp_models[variant]), dtype=torch.float32, device=torch.device("cpu")).model
    monkeypatch.setattr(weights._Checkpoint, "get", spy)
    shards = [
        load_model(
            str(tp_models[variant]), dtype=torch.float32, device=torch.device("cpu"), group=RankOf(r, 2)
        ).model
        for r in range(2)
    ]
    assert whole_reads and all(name.endswith("norm.weight") or "o_proj.bias" in name for name in whole_reads)
    params = [dict(shard.named_parameters()) for shard in shards]
    for name, whole in full.named_parameters():
        parts: list[torch.Tensor] = [p[name] for p in params]
        if name.endswith("qkv_proj.weight"):
            q_rows, kv_rows = 32, 16  # 2 of 4 query heads of 16 per rank; the one KV head, or one of two
            qs = [part[:q_rows] for part in parts]
            torch.testing.assert_close(torch.cat(qs), whole[: 2 * q_rows], rtol=0, atol=0)
            ks = [part[q_rows : q_rows + kv_rows] for part in parts]
            want_k = whole[64 : 64 + kv_rows] if variant == "llama_kv1" else whole[64 : 64 + 2 * kv_rows]
            torch.testing.assert_close(
                ks[0] if variant == "llama_kv1" else torch.cat(ks), want_k, rtol=0, atol=0
            )
            if variant == "llama_kv1":
                torch.testing.assert_close(ks[1], ks[0], rtol=0, atol=0)  # replicated
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            torch.testing.assert_close(torch.cat(parts, dim=1), whole, rtol=0, atol=0)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            # The last rank's run is padded with zero rows past the vocabulary (401 = 201 + 200).
            torch.testing.assert_close(torch.cat(parts)[: whole.shape[0]], whole, rtol=0, atol=0)
            assert not torch.cat(parts)[whole.shape[0] :].any()
        elif name.endswith("gate_up_proj.weight"):
            inner = whole.shape[0] // 2
            gates = torch.cat([part[: inner // 2] for part in parts])
            ups = torch.cat([part[inner // 2 :] for part in parts])
            torch.testing.assert_close(torch.cat([gates, ups]), whole, rtol=0, atol=0)
        elif whole.dim() == 1 and "qkv_proj" not in name:
            assert all(torch.equal(part, whole) for part in parts), name
