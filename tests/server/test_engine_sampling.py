"""The engine's sampling through the fused op: seeded requests whatever the batch, `seed` seeding the engine, and a
NaN row failing its request alone."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from executor_hooks import hook_steps
from pagoda.scheduler import SchedulerOutput
from pagoda.server.llm import LLM
from pagoda.server.outputs import RequestOutput
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import make_tiny_model


def random_prompts(count: int, seed: int) -> list[list[int]]:
    """`count` token-id prompts of 3 to 20 tokens (ids clear of the special tokens)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 21, (count,), generator=g).tolist()
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Qwen2 model folder."""
    return make_tiny_model("qwen2", tmp_path_factory.mktemp("sampling-engine") / "qwen2")


def make_llm(model_dir: Path, **kwargs: Any) -> LLM:
    """An LLM on the tiny model with block size 4, a small pool, float32."""
    args: dict[str, Any] = {"block_size": 4, "num_kv_blocks": 256, "max_model_len": 64, "dtype": "float32"}
    args.update(kwargs)
    return LLM(str(model_dir), **args)


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    """Each request's first sample's tokens."""
    return [list(o.outputs[0].token_ids) for o in outputs]


# Seeded and unseeded rows of every kind: plain temperature, top_p, top_k, min_p, greedy, and n = 2.
_BASE: dict[str, Any] = {"temperature": 1.0, "max_tokens": 8, "ignore_eos": True}
_KINDS: tuple[dict[str, Any], ...] = (
    {"seed": 7},
    {},
    {"top_p": 0.9, "seed": 8},
    {"top_p": 0.8},
    {"top_k": 5, "seed": 9},
    {"top_k": 20},
    {"min_p": 0.05, "seed": 10},
    {"min_p": 0.1, "top_p": 0.95},
    {"temperature": 0.0},
    {"temperature": 0.7, "seed": 11, "n": 2},
    {"temperature": 1.3},
    {"top_k": 50, "top_p": 0.95, "seed": 12},
    {"repetition_penalty": 1.3},
    {"temperature": 0.5, "seed": 13},
    {"presence_penalty": 0.5, "seed": 14},
)
MIXED = [SamplingParams(**{**_BASE, **kind}) for kind in _KINDS]


@pytest.mark.parametrize("kernel_backend", ["cpu", "torch"])
def test_seeded_request_same_alone_and_in_a_batch_of_16(model_dir: Path, kernel_backend: str) -> None:
    """A seeded request gives the same tokens alone as among 15 mixed seeded and unseeded requests, at any place."""
    llm = make_llm(model_dir, kernel_backend=kernel_backend)
    prompt = random_prompts(1, 0)[0]
    target = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234, max_tokens=10, ignore_eos=True)
    alone = tokens(llm.generate([prompt], target, use_tqdm=False))[0]
    others = random_prompts(15, 1)
    for place in (0, 7, 15):
        prompts = [*others[:place], prompt, *others[place:]]
        params = [*MIXED[:place], target, *MIXED[place:]]
        assert tokens(llm.generate(prompts, params, use_tqdm=False))[place] == alone
    assert len(set(alone)) > 1, "the request must actually sample"


def test_the_engine_seed_seeds_unseeded_requests(model_dir: Path) -> None:
    """Two engines with the same `seed` give unseeded requests the same tokens; another seed gives others."""
    prompts = random_prompts(4, 2)
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)

    def run(seed: int) -> list[list[int]]:
        return tokens(make_llm(model_dir, seed=seed).generate(prompts, params, use_tqdm=False))

    first = run(5)
    assert run(5) == first
    assert run(6) != first
    assert len({tuple(t) for t in first}) == len(first), "unseeded requests take distinct keys"


def test_a_nan_row_aborts_its_request_and_the_others_go_on(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """NaN logits in one request's row finish that request as aborted, with an error logged; the others finish
    with the tokens they get without it."""
    prompts = random_prompts(3, 3)
    params = [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=4, max_tokens=8, ignore_eos=True),
    ]
    llm = make_llm(model_dir)
    clean = tokens(llm.generate(prompts, params, use_tqdm=False))
    engine = llm.engine
    calls = 0

    def poisoned(output: SchedulerOutput, model_logits: torch.Tensor) -> torch.Tensor:
        """The model's logits, with NaN in the row of request "bad" on its third step."""
        nonlocal calls
        logits = model_logits.clone()  # an inference tensor: a clone may be edited
        rows = [seq_id for chunk in output.scheduled for seq_id in chunk.sample_ids]
        if "bad" in rows:
            calls += 1
            if calls == 3:
                logits[rows.index("bad"), 5] = float("nan")
        return logits

    hook_steps(engine, poisoned)
    for request_id, prompt, sp in zip(("a", "bad", "c"), prompts, params, strict=True):
        engine.add_request(request_id, prompt, sp)
    finished: dict[str, RequestOutput] = {}
    with caplog.at_level(logging.ERROR):
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
    bad = finished["bad"].outputs[0]
    assert bad.finish_reason == "abort"
    assert list(bad.token_ids) == clean[1][:2]
    assert [list(finished[r].outputs[0].token_ids) for r in ("a", "c")] == [clean[0], clean[2]]
    assert [finished[r].outputs[0].finish_reason for r in ("a", "c")] == ["length", "length"]
    assert "request bad aborted" in caplog.text and "NaN" in caplog.text
    assert not engine.has_unfinished_requests() and engine.get_stats().num_running == 0
