"""Sleep mode under tensor parallelism: the worker's shard and KV pool sleep and wake with the driver's.

A TP=2 engine (the driver in this process, rank 1 a worker process) sleeps at level 1 and 2 and wakes (whole, and
weights and KV pool one at a time); each time the worker answers with what it holds (no weight byte and no KV
tensor while asleep), and the greedy tokens after every wake equal those before and TP=1's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pagoda.server.engine.executor.messages import RankSleepState
from pagoda.server.llm import LLM
from pagoda.server.models.quantized import resident_weight_bytes
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Hello world! How are you today?"]


def _asleep(llm: LLM) -> bool:
    """engine.is_sleeping, read afresh (a call: mypy keeps no earlier assert's narrowing)."""
    return llm.engine.is_sleeping


def _greedy(llm: LLM) -> list[tuple[int, ...]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.timeout(600)
def test_tp2_shards_sleep_and_wake_with_the_same_greedy_tokens(tmp_path: Path) -> None:
    model = str(make_tiny_model("llama", tmp_path / "llama", num_key_value_heads=4))
    flags = {"dtype": "float32", "kv_cache_gib": 0.01, "enable_sleep_mode": True}
    single = LLM(model, **flags)
    expected = _greedy(single)
    single.engine.close()
    llm = LLM(model, tensor_parallel_size=2, **flags)
    try:
        engine = llm.engine
        sleeping = engine.sleeping
        assert sleeping is not None
        assert _greedy(llm) == expected
        driver_bytes = resident_weight_bytes(engine.runner.model)
        assert driver_bytes > 0
        awake_states: list[object] = []
        for level in (1, 2):
            llm.sleep(level)
            assert _asleep(llm)
            assert resident_weight_bytes(engine.runner.model) == 0
            assert engine.runner.kv_cache.device_caches == []
            assert sleeping.follower_states == (RankSleepState(rank=1, weight_bytes=0, kv_tensors=0),)
            if level == 1:
                llm.wake_up()
            else:  # one part at a time: the worker follows each
                llm.wake_up(["weights"])
                (state,) = sleeping.follower_states
                assert isinstance(state, RankSleepState) and state.weight_bytes > 0 and state.kv_tensors == 0
                llm.wake_up(["kv_cache"])
            assert not _asleep(llm)
            assert resident_weight_bytes(engine.runner.model) == driver_bytes
            (state,) = sleeping.follower_states
            assert isinstance(state, RankSleepState) and state.weight_bytes > 0 and state.kv_tensors > 0
            awake_states.append(state)
            assert _greedy(llm) == expected, level
        assert awake_states[0] == awake_states[1]  # the shard read back whole, both times
    finally:
        llm.engine.close()
