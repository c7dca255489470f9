"""--speculative-config and LLM(speculative_config=...): vLLM's JSON keys, and bad values exit 2 naming the key."""

from __future__ import annotations

import pytest
from pagoda.server.cli import build_parser, engine_config, main
from pagoda.server.spec import SpeculativeConfig, parse_speculative_config
from pagoda.server.spec.ngram import NgramProposer


def test_flag_maps_onto_the_engine_config() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "m",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}',
        ]
    )
    assert engine_config(args).speculative_config == SpeculativeConfig("ngram", 3, 4, 1)
    assert engine_config(build_parser().parse_args(["serve", "m"])).speculative_config is None


@pytest.mark.parametrize(
    ("value", "key"),
    [
        ("{not json", "not valid JSON"),
        ('{"method": "medusa2"}', "'method'"),
        ('{"method": "draft_model"}', "'model'"),
        ('{"method": "eagle"}', "not available yet"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "'num_speculative_tokens'"),
        ('{"method": "ngram", "num_speculative_tokens": "4"}', "'num_speculative_tokens'"),
        ('{"method": "ngram", "prompt_lookup_min": 0}', "'prompt_lookup_min'"),
        ('{"method": "ngram", "prompt_lookup_max": 2, "prompt_lookup_min": 3}', "'prompt_lookup_min'"),
        ('{"method": "ngram", "model": "tiny"}', "'model'"),
        ('{"method": "ngram", "speculative_tokens": 4}', "speculative_tokens"),
        ('{"num_speculative_tokens": 4}', "'method'"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_bad_config_exits_2_naming_the_key(value: str, key: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "m", "--speculative-config", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--speculative-config" in err and key in err


def test_one_lookup_size_sets_a_consistent_other() -> None:
    assert parse_speculative_config({"method": "ngram", "prompt_lookup_max": 1}).prompt_lookup_min == 1
    assert parse_speculative_config({"method": "ngram", "prompt_lookup_min": 7}).prompt_lookup_max == 7
    assert parse_speculative_config(SpeculativeConfig()) == SpeculativeConfig()


def test_ngram_prompt_lookup() -> None:
    """The latest earlier match of the longest suffix (max down to min) gives the tokens that followed it."""
    ngram = NgramProposer(3, min_n=1, max_n=3)
    assert ngram.propose([1, 2, 3, 4, 1, 2, 3], 5) == (4, 1, 2)
    assert ngram.propose([1, 2, 3, 4, 1, 2, 3], 2) == (4, 1)  # the caller's cap
    assert ngram.propose([9, 5, 7, 5, 8, 5], 3) == (8, 5)  # the latest occurrence of "5"; what follows
    assert ngram.propose([1, 2, 3, 9], 3) == ()  # no earlier 9
    # The 2-gram (1, 2) beats the more recent 1-gram match of "2".
    assert NgramProposer(2, 1, 2).propose([1, 2, 7, 2, 8, 1, 2], 2) == (7, 2)
    assert NgramProposer(2, 2, 2).propose([3, 2, 8, 2], 2) == ()  # 1-grams below prompt_lookup_min
    with pytest.raises(ValueError):
        NgramProposer(2, 3, 2)
