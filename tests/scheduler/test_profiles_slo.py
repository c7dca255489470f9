"""Scheduling profiles (presets scaled to the KV pool) and the SLO targets of `SchedulerConfig`."""

from __future__ import annotations

import pytest
from pagoda.scheduler import (
    PRESETS,
    AdaptivePolicy,
    FCFSPolicy,
    RequestSLO,
    SchedulerConfig,
    apply_profile,
    build_policy,
    parse_slo_targets,
    scaled_preset,
)


def test_a_large_pool_keeps_the_documents_values() -> None:
    """A GPU-sized pool: the design document's numbers as they are."""
    config = SchedulerConfig(scheduling_profile="throughput")
    applied = apply_profile(config, num_blocks=1 << 16, block_size=16)
    assert (applied.max_num_batched_tokens, applied.max_num_seqs) == (16384, 512)
    assert applied.long_prefill_token_threshold is None and applied.enable_prefix_caching
    latency = apply_profile(SchedulerConfig(scheduling_profile="latency"), 1 << 16, 16)
    assert (latency.max_num_batched_tokens, latency.max_num_seqs, latency.long_prefill_token_threshold) == (
        512,
        32,
        256,
    )
    balanced = apply_profile(SchedulerConfig(scheduling_profile="balanced"), 1 << 16, 16)
    assert (balanced.max_num_batched_tokens, balanced.max_num_seqs) == (8192, 128)


def test_a_small_pool_scales_the_presets_down() -> None:
    """64 blocks of 16 tokens: seats <= blocks / 2, budget <= pool / 4, chunk <= budget."""
    preset = scaled_preset("throughput", num_blocks=64, block_size=16)
    assert preset.max_num_seqs == 32 and preset.max_num_batched_tokens == 256
    tiny = scaled_preset("latency", num_blocks=8, block_size=4)
    assert (
        tiny.max_num_batched_tokens == 16
        and tiny.long_prefill_token_threshold == 16
        and tiny.max_num_seqs == 4
    )


def test_no_profile_changes_nothing_and_without_chunking_a_prompt_still_fits() -> None:
    """None leaves the knobs; a profile without chunked prefill keeps the budget >= max_model_len."""
    config = SchedulerConfig(max_num_seqs=7)
    assert apply_profile(config, 64, 16) is config
    whole = SchedulerConfig(
        scheduling_profile="latency", enable_chunked_prefill=False, max_num_batched_tokens=2048
    )
    assert apply_profile(whole, 1 << 16, 16).max_num_batched_tokens == 2048


def test_prefix_caching_off_by_flag_stays_off() -> None:
    """A profile turns prefix caching on only where the embedder allows it (contiguous KV cannot share)."""
    config = SchedulerConfig(scheduling_profile="balanced", enable_prefix_caching=False)
    assert not apply_profile(config, 1 << 16, 16).enable_prefix_caching


def test_adaptive_builds_the_adaptive_policy_scaled_to_the_pool() -> None:
    """The profile, not the policy name, makes `build_policy` return an AdaptivePolicy."""
    policy = build_policy(SchedulerConfig(scheduling_profile="adaptive"), pool=(64, 16))
    assert isinstance(policy, AdaptivePolicy)
    assert policy.latency == scaled_preset("latency", 64, 16)
    assert isinstance(build_policy(SchedulerConfig(scheduling_profile="latency")), FCFSPolicy)
    assert PRESETS["adaptive"].max_num_batched_tokens == PRESETS["throughput"].max_num_batched_tokens


def test_slo_targets_parse_numbers_text_and_classes() -> None:
    """A number, "MS" or "MS,PRIORITY:MS..." and a mapping all give the canonical tuple, default first."""
    assert parse_slo_targets(500, "slo_ttft_ms") == ((None, 500.0),)
    assert parse_slo_targets("2000, 1:5000, 0:300", "x") == ((None, 2000.0), (0, 300.0), (1, 5000.0))
    assert parse_slo_targets({0: 100, None: 50}, "x") == ((None, 50.0), (0, 100.0))
    assert parse_slo_targets(None, "x") == ()
    config = SchedulerConfig(slo_ttft_ms="1000,0:250", slo_tpot_ms=80)  # type: ignore[arg-type]
    assert config.slo_ms("ttft", 0) == 250.0 and config.slo_ms("ttft", 3) == 1000.0
    assert config.slo_ms("tpot", 0) == 80.0
    assert SchedulerConfig(slo_ttft_ms="0:250").slo_ms("ttft", 1) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "value",
    [-1, 0, "abc", "0:-5", float("nan"), True, "1:100,1:200", "x:100", [(0, 1, 2)]],
)
def test_bad_slo_targets_name_the_field(value: object) -> None:
    """Negative, zero, non-numbers, a class twice or a bad class: ValueError naming slo_tpot_ms."""
    with pytest.raises(ValueError, match="slo_tpot_ms"):
        SchedulerConfig(slo_tpot_ms=value)  # type: ignore[arg-type]


def test_unknown_profile_and_bad_request_slo_are_refused() -> None:
    """An unknown profile names the field; a request's own SLO must be positive."""
    with pytest.raises(ValueError, match="scheduling_profile"):
        SchedulerConfig(scheduling_profile="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"slo\.ttft_ms"):
        RequestSLO(ttft_ms=-3)
    with pytest.raises(ValueError, match=r"slo\.tpot_ms"):
        RequestSLO(tpot_ms=float("inf"))
