"""The flags of issue 28's structured-outputs and HTTP bounds: each reaches its config field, and a bad value
exits 2 naming the flag before any model loads."""

from __future__ import annotations

import pytest
from pagoda.server.cli import main
from pagoda.server.cli_args import build_parser, serve_config


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        (["--limit-concurrency", "0"], "--limit-concurrency"),
        (["--request-body-deadline", "0"], "--request-body-deadline"),
        (["--max-grammar-chars", "0"], "--max-grammar-chars"),
        (["--grammar-compile-timeout", "0"], "--grammar-compile-timeout"),
        (["--grammar-cache-bytes", "1000"], "--grammar-cache-bytes"),
        (["--grammar-fill-timeout", "-1"], "--grammar-fill-timeout"),
    ],
)
def test_bad_values_exit_2_naming_the_flag(
    flags: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Zero, negative or too small: exit 2, the message naming the flag."""
    assert main(["serve", "unused-model", *flags]) == 2
    assert flag in capsys.readouterr().err


def test_the_flags_reach_their_fields() -> None:
    """Each flag sets its section's field."""
    flags = ["--limit-concurrency", "64", "--request-body-deadline", "45", "--max-grammar-chars", "5000"]
    flags += [
        "--grammar-compile-timeout",
        "3",
        "--grammar-cache-bytes",
        "2097152",
        "--grammar-fill-timeout",
        "0.5",
    ]
    config = serve_config(build_parser().parse_args(["serve", "m", *flags]))
    assert (config.server.limits.limit_concurrency, config.server.limits.body_deadline) == (64, 45.0)
    assert (config.app.max_grammar_chars, config.app.grammar_compile_timeout) == (5000, 3.0)
    structured = config.engine.structured_outputs_config
    assert (structured.grammar_cache_bytes, structured.grammar_fill_timeout) == (2097152, 0.5)
