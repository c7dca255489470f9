"""The engine flags of `pagoda bench throughput | latency`: every `pagoda serve` flag of the engine's sections
(vLLM's benchmarks take its engine arguments the same way), with `--model` for the positional model.

Only the flags given reach the engine (argparse.SUPPRESS defaults), so the config's own defaults apply otherwise;
a bad value exits 2 naming its flag, as `pagoda serve` does.
"""

from __future__ import annotations

import argparse
from typing import Any

from pagoda.server.cli_args import argument_table, flag_message
from pagoda.server.config import EngineConfig, ServeConfig
from pagoda.server.config_tree import flat_names
from pagoda.server.packaged import model_help


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Add `--model` and the engine's `pagoda serve` flags (TGI's aliases left out) to `parser`."""
    paths = flat_names(ServeConfig())
    group = parser.add_argument_group("engine", "the engine's flags, as `pagoda serve` takes them")
    for flag in argument_table():
        if flag.alias_of is not None or paths[flag.dest][0] != "engine":
            continue
        if flag.options == ("model",):
            group.add_argument("--model", default=argparse.SUPPRESS, help=model_help())
        else:
            group.add_argument(*flag.options, default=argparse.SUPPRESS, **flag.kwargs)


def engine_kwargs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """`LLM`'s keywords of the engine flags given; a config error exits 2 (parser.error) naming the flag."""
    table = argument_table()
    paths = flat_names(ServeConfig())
    names = {flag.dest for flag in table if flag.alias_of is None and paths[flag.dest][0] == "engine"}
    kwargs = {name: value for name, value in vars(args).items() if name in names}
    try:
        EngineConfig.from_flat(**kwargs)  # validated here, so that a bad value fails before any weight loads
    except ValueError as exc:
        parser.error(flag_message(str(exc), table))
    return kwargs
