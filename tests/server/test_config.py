"""The one configuration: every flag is one field of one section, `LLM(**kwargs)` and the CLI build the same
tree through the same builder, each section names the field it refuses, and the engine hands the scheduler
section itself (its model-derived limits filled in) to the Scheduler."""

from __future__ import annotations

import argparse
import inspect
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec
import pytest
from pagoda.scheduler import SchedulerConfig
from pagoda.server import cli
from pagoda.server.cli import build_parser, engine_config, serve_config
from pagoda.server.cli_args import argument_table
from pagoda.server.config import (
    AppSettings,
    CacheConfig,
    CoreClientConfig,
    EngineConfig,
    HTTPLimits,
    ModelConfig,
    ParallelConfig,
    RequestLimits,
    ServeConfig,
    ServerConfig,
    ServingConfig,
)
from pagoda.server.config_tree import build_config, flat_names
from pagoda.server.engine import LLMEngine
from pagoda.server.llm import LLM
from pagoda.server.testing import make_tiny_model


@dataclass(frozen=True)
class _BlockOnly:
    """A section that declares block_size, like CacheConfig."""

    block_size: int = 16


@dataclass(frozen=True)
class _TwiceTree:
    """A tree whose two sections both declare block_size."""

    cache: CacheConfig = field(default_factory=CacheConfig)
    other: _BlockOnly = field(default_factory=_BlockOnly)


def _serve_parser() -> argparse.ArgumentParser:
    """The `serve` subparser of the CLI."""
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            parser: argparse.ArgumentParser = action.choices["serve"]
            return parser
    raise AssertionError("no serve command")


def test_every_cli_destination_is_exactly_one_section_field() -> None:
    """No orphan flag, no field set by two flags; TGI aliases name a field and are none themselves."""
    names = flat_names(ServeConfig())
    table = argument_table()
    owners: dict[str, str] = {}
    for flag in table:
        if flag.alias_of is not None:
            assert flag.alias_of in names, flag.options
            assert flag.dest not in names, f"the alias {flag.options[0]} shadows a field"
            continue
        assert flag.dest in names, f"{flag.options[0]} sets no config field"
        assert flag.dest not in owners, f"{flag.options[0]} and {owners[flag.dest]} both set {flag.dest}"
        owners[flag.dest] = flag.options[0]
    dests = {action.dest for action in _serve_parser()._actions} - {"help"}
    assert dests == {flag.dest for flag in table}


def test_flat_names_are_unique_and_a_duplicate_is_refused() -> None:
    """Each leaf has one path; a field name declared by two sections is an error, not a silent choice."""
    names = flat_names(ServeConfig())
    assert names["max_num_seqs"] == ("engine", "scheduler_config", "max_num_seqs")
    assert names["max_head_bytes"] == ("server", "limits", "max_head_bytes")
    assert names["max_prompts_per_request"] == ("app", "limits", "max_prompts_per_request")
    with pytest.raises(ValueError, match="block_size is a field of two sections"):
        flat_names(_TwiceTree())


def test_help_groups_the_flags_by_section() -> None:
    """`pagoda serve --help`: one argument group per section, each flag in its field's section."""
    groups = {group.title: {a.dest for a in group._group_actions} for group in _serve_parser()._action_groups}
    assert {"max_num_seqs", "max_batch_size", "scheduling_policy", "enable_chunked_prefill"} <= groups[
        "scheduler"
    ]
    assert {"block_size", "swap_space_gib", "kv_manager"} <= groups["cache"]
    assert {"tensor_parallel_size", "distributed_executor_backend"} <= groups["parallel"]
    assert {"data_parallel_size", "routing_policy", "engine_core"} <= groups["engine cores"]
    assert {"max_head_bytes", "head_timeout", "body_timeout", "body_deadline", "limit_concurrency"} == groups[
        "HTTP limits"
    ]
    assert {"model", "tokenizer", "dtype", "max_input_tokens", "max_input_length"} <= (
        groups["model"] | groups["positional arguments"]
    )


# The same settings as flags and as LLM keywords (flat name == CLI destination == field name).
_SAME_SETTINGS: list[tuple[list[str], dict[str, Any]]] = [
    ([], {}),
    (
        ["m", "--max-model-len", "512", "--max-num-seqs", "8", "--block-size", "32", "--swap-space", "2"],
        {"model": "m", "max_model_len": 512, "max_num_seqs": 8, "block_size": 32, "swap_space_gib": 2.0},
    ),
    (
        ["--scheduling-policy", "static", "--static-batch-timeout", "0.5", "--kv-manager", "contiguous"],
        {"scheduling_policy": "static", "static_batch_timeout_s": 0.5, "kv_manager": "contiguous"},
    ),
    (
        ["--max-total-tokens", "300", "--max-batch-size", "4", "--max-input-length", "100", "-tp", "2"],
        {"max_model_len": 300, "max_num_seqs": 4, "max_input_tokens": 100, "tensor_parallel_size": 2},
    ),
    (
        ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "4096", "--preemption-mode", "swap"],
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096, "preemption_mode": "swap"},
    ),
]


@pytest.mark.parametrize(("flags", "kwargs"), _SAME_SETTINGS)
def test_llm_keywords_and_the_cli_build_equal_configs(
    flags: list[str], kwargs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`LLM(**kwargs)` reaches the engine with the config `pagoda serve` builds from the same settings."""
    from_cli = engine_config(build_parser().parse_args(["serve", *flags]))
    assert [llm_config(monkeypatch, **kwargs)] == [from_cli] == [EngineConfig.from_flat(**kwargs)]


def test_an_unknown_keyword_is_an_error_naming_it() -> None:
    """A misspelt flat name is refused (TypeError naming it) by the builder, EngineConfig.from_flat and LLM."""
    with pytest.raises(TypeError, match=r"max_num_seq$"):
        EngineConfig.from_flat(max_num_seq=8)
    with pytest.raises(TypeError, match="bogus, port"):
        LLM(port=1, bogus=True)  # the server's fields are no engine keywords either
    with pytest.raises(TypeError, match="watermark_x"):
        build_config(ServeConfig(), {"watermark_x": 0.1})
    assert ServeConfig.from_flat(port=1, watermark=0.5).engine.scheduler_config.watermark == 0.5


@pytest.mark.parametrize(
    ("section", "kwargs", "name"),
    [
        (ModelConfig, {"max_input_tokens": 0}, "max_input_tokens"),
        (ModelConfig, {"dtype": "int8"}, "dtype"),
        (CacheConfig, {"block_size": 0}, "block_size"),
        (CacheConfig, {"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
        (CacheConfig, {"kv_cache_gib": 0.0}, "kv_cache_gib"),
        (CacheConfig, {"swap_space_gib": -1.0}, "swap_space_gib"),
        (CacheConfig, {"num_kv_blocks": 0}, "num_kv_blocks"),
        (CacheConfig, {"kv_manager": "slab"}, "kv_manager"),
        (SchedulerConfig, {"max_num_seqs": 0}, "max_num_seqs"),
        (SchedulerConfig, {"max_model_len": 0}, "max_model_len"),
        (SchedulerConfig, {"long_prefill_token_threshold": 0}, "long_prefill_token_threshold"),
        (SchedulerConfig, {"scheduling_policy": "lifo"}, "scheduling_policy"),
        (SchedulerConfig, {"static_batch_timeout_s": -1.0}, "static_batch_timeout_s"),
        (ParallelConfig, {"tensor_parallel_size": 0}, "tensor_parallel_size"),
        (ParallelConfig, {"distributed_executor_backend": "slurm"}, "distributed_executor_backend"),
        (CoreClientConfig, {"data_parallel_size": 0}, "data_parallel_size"),
        (CoreClientConfig, {"engine_ready_timeout": 0.0}, "engine_ready_timeout"),
        (ServingConfig, {"max_waiting_requests": 0}, "max_waiting_requests"),
        (ServingConfig, {"max_concurrent_requests": 0}, "max_concurrent_requests"),
        (ServingConfig, {"metrics_prefix": "9lives"}, "metrics_prefix"),
        (RequestLimits, {"max_prompts_per_request": 0}, "max_prompts_per_request"),
        (AppSettings, {"max_body_bytes": 0}, "max_body_bytes"),
        (AppSettings, {"enable_auto_tool_choice": True}, "enable_auto_tool_choice"),
        (HTTPLimits, {"max_head_bytes": 100}, "max_head_bytes"),
        (HTTPLimits, {"body_timeout": 0.0}, "body_timeout"),
        (ServerConfig, {"port": 70000}, "port"),
        (ServerConfig, {"shutdown_timeout": -1.0}, "shutdown_timeout"),
    ],
)
def test_each_section_names_the_field_it_refuses(section: type, kwargs: dict[str, Any], name: str) -> None:
    """Validation lives once, in the section's __post_init__, and the ValueError names the field."""
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        section(**kwargs)


def test_the_cli_names_the_flag_and_the_field() -> None:
    """A bad value through the CLI is said with its flag, the field after it."""
    args = build_parser().parse_args(["serve", "--swap-space", "-1"])
    with pytest.raises(ValueError, match=r"^--swap-space must be >= 0, got -1.0 \(swap_space_gib\)$"):
        serve_config(args)


def test_the_scheduler_section_is_the_schedulers_own_config() -> None:
    """No copy: the engine's scheduler section is a SchedulerConfig whose model-derived limits start unset."""
    section = EngineConfig().scheduler_config
    assert type(section) is SchedulerConfig
    assert (section.max_model_len, section.max_num_batched_tokens) == (None, None)
    assert SchedulerConfig().max_model_len == 2048  # the scheduler package's own default stands


def test_the_engine_config_crosses_processes_as_msgpack() -> None:
    """Engine cores and tensor-parallel workers receive the whole tree; it survives msgspec both ways."""
    config = EngineConfig.from_flat(
        model="m", max_num_seqs=3, kv_manager="contiguous", tensor_parallel_size=2
    )
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(config), type=EngineConfig) == config


def test_the_engine_passes_the_filled_scheduler_section_and_close_stops_the_executor(tmp_path: Path) -> None:
    """LLMEngine gives the Scheduler its config's section with max_model_len and the budget filled in (the
    contiguous manager shares no prefix); close() shuts the executor down (the EngineClient seam)."""
    model = make_tiny_model("llama", tmp_path / "llama")
    config = EngineConfig.from_flat(
        model=str(model),
        max_model_len=64,
        num_kv_blocks=32,
        block_size=4,
        kv_manager="contiguous",
        dtype="float32",
    )
    engine = LLMEngine.from_config(config)
    expected = replace(
        config.scheduler_config, max_model_len=64, max_num_batched_tokens=2048, enable_prefix_caching=False
    )
    assert engine.scheduler.config == expected
    stopped: list[bool] = []
    engine.executor.shutdown = lambda: stopped.append(True)  # type: ignore[method-assign]
    engine.close()
    assert stopped == [True]


def test_serve_closes_any_engine_client_without_asking_its_type() -> None:
    """`cli.serve` releases the engine through EngineClient.close, with no isinstance on the client."""
    assert "isinstance" not in inspect.getsource(cli)


def llm_config(monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> EngineConfig:
    """The config `LLM(**kwargs)` hands the engine (no model is loaded)."""
    seen: list[EngineConfig] = []

    class _Engine:
        tokenizer = None
        model_path = Path("/no-such-model")  # no config.json: a text-only model, no image processor

    def from_config(config: EngineConfig) -> Any:
        seen.append(config)
        return _Engine()

    monkeypatch.setattr(LLMEngine, "from_config", staticmethod(from_config))
    LLM(**kwargs)
    (config,) = seen
    return config
