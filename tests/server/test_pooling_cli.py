"""Issue 26 (embeddings): --runner, its older alias --task embed, and --pooler-config's validation (exit 2 naming
the key), before any model loads."""

from __future__ import annotations

import pytest
from pagoda.server.cli import build_parser, engine_config, main
from pagoda.server.config import EngineConfig, PoolerConfig


def parsed(*flags: str) -> EngineConfig:
    """The engine config of `pagoda serve` with these flags."""
    return engine_config(build_parser().parse_args(["serve", "m", *flags]))


def test_runner_task_alias_and_pooler_config_reach_the_model_config() -> None:
    """--runner pooling, --task embed (vLLM's older spelling) and --pooler-config's JSON land in ModelConfig."""
    assert parsed().model_config.runner == "generate"
    assert parsed().model_config.pooler_config is None
    assert parsed("--runner", "pooling").model_config.runner == "pooling"
    assert parsed("--task", "embed").model_config.runner == "pooling"
    assert parsed("--task", "generate").model_config.runner == "generate"
    config = parsed("--runner", "pooling", "--pooler-config", '{"pooling_type": "mean", "normalize": false}')
    assert config.model_config.pooler_config == PoolerConfig("MEAN", normalize=False)
    assert parsed("--pooler-config", "{}").model_config.pooler_config == PoolerConfig()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--pooler-config", "{not json"], "not valid JSON"),
        (["--pooler-config", "[1]"], "JSON object"),
        (["--pooler-config", '{"pooling_type": "MAX"}'], "pooling_type"),
        (["--pooler-config", '{"pooling": "MEAN"}'], "'pooling'"),
        (["--pooler-config", '{"normalize": "yes"}'], "normalize"),
        (["--task", "classify"], "--task"),
        (["--runner", "embed"], "--runner"),
    ],
)
def test_bad_runner_flags_exit_2_naming_the_key(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad --pooler-config (bad JSON, an unknown pooling_type or key, a non-boolean normalize), an unknown --task
    or --runner: exit 2 naming the flag and the key."""
    with pytest.raises(SystemExit) as info:
        main(["serve", "unused-model", *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert flags[0] in err, err


def test_task_and_runner_must_agree(capsys: pytest.CaptureFixture[str]) -> None:
    """--task embed with --runner generate: exit 2 naming both."""
    assert main(["serve", "unused-model", "--runner", "generate", "--task", "embed"]) == 2
    err = capsys.readouterr().err
    assert "--task" in err and "--runner" in err, err


def test_offline_pooler_config_is_validated() -> None:
    """LLM's keywords reach the same section: a dict is taken as the flag's JSON, a bad key named."""
    config = EngineConfig.from_flat(runner="pooling", pooler_config={"pooling_type": "CLS"})
    assert config.model_config.pooler_config == PoolerConfig("CLS")
    with pytest.raises(ValueError, match="pooling_type"):
        EngineConfig.from_flat(pooler_config={"pooling_type": "SUM"})
    with pytest.raises(ValueError, match="runner"):
        EngineConfig.from_flat(runner="embed")
