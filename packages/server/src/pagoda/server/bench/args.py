"""The flags of `pagoda bench serve | throughput | latency`, named as `vllm bench`'s.

Imports nothing heavy (`pagoda --help` stays fast); each benchmark's module is imported when it runs. A bad flag
or value exits 2 naming the flag (argparse's error).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from pagoda.server.bench.engine_flags import add_engine_flags

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
# vLLM's --backend names the request format; these are the OpenAI-compatible ones.
BACKEND_ENDPOINTS = {
    "vllm": "/v1/completions",
    "openai": "/v1/completions",
    "openai-chat": "/v1/chat/completions",
}
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def range_ratio(text: str) -> float:
    """A length spread in [0, 1)."""
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def request_rate(text: str) -> float:
    """Requests per second > 0, or inf (all at once)."""
    value = float(text)
    if not value > 0.0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {text}")
    return value


def burstiness(text: str) -> float:
    """vLLM's --burstiness: the gamma shape of the arrival gaps, > 0 (1: Poisson; lower: burstier)."""
    value = float(text)
    if not (value > 0.0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def goodput_slo(text: str) -> tuple[str, float]:
    """One of vLLM's --goodput service-level objectives, "METRIC:MILLISECONDS" (ttft, tpot or e2el)."""
    name, sep, value = text.partition(":")
    if not sep or name not in GOODPUT_METRICS:
        raise argparse.ArgumentTypeError(
            f"must be METRIC:MS with METRIC one of {', '.join(GOODPUT_METRICS)}, got {text!r}"
        )
    try:
        ms = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{name}'s objective must be a number of milliseconds, got {value!r}"
        ) from None
    if not (ms > 0.0 and math.isfinite(ms)):
        raise argparse.ArgumentTypeError(f"{name}'s objective must be > 0 ms, got {value!r}")
    return name, ms


def temperature(text: str) -> float:
    """A sampling temperature in [0, 2], as the API takes."""
    value = float(text)
    if not 0.0 <= value <= 2.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 2], got {value}")
    return value


def key_value(text: str) -> str:
    """KEY=VALUE (a --metadata item)."""
    if "=" not in text or text.startswith("="):
        raise argparse.ArgumentTypeError(f"must be KEY=VALUE, got {text!r}")
    return text


def percentiles(text: str) -> tuple[float, ...]:
    """Comma-separated percentiles in (0, 100], as vLLM's --metric-percentiles ("25,50,99")."""
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers, got {text!r}") from None
    if not all(0.0 < v <= 100.0 and math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"percentiles must be in (0, 100], got {text!r}")
    return values


def metric_names(text: str) -> tuple[str, ...]:
    """Comma-separated metrics among ttft, tpot, itl and e2el, as vLLM's --percentile-metrics."""
    names = tuple(part.strip() for part in text.split(","))
    unknown = [name for name in names if name not in PERCENTILE_METRICS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown metric(s) {', '.join(unknown)}; use {','.join(PERCENTILE_METRICS)}"
        )
    return names


def add_arrival_flags(group: Any) -> None:  # an argparse parser or argument group
    """vLLM's --burstiness and --goodput, shared by `pagoda bench serve` and tools/bench_serving.py."""
    group.add_argument(
        "--burstiness",
        type=burstiness,
        default=1.0,
        help="gamma shape of the arrival gaps at --request-rate (1: Poisson; below 1 burstier, above steadier)",
    )
    group.add_argument(
        "--goodput",
        type=goodput_slo,
        nargs="+",
        default=None,
        metavar="METRIC:MS",
        help="service-level objectives (ttft, tpot, e2el in ms, e.g. ttft:500 tpot:50): also report the "
        "requests per second that met all of them",
    )


def add_bench_commands(commands: Any) -> None:  # argparse's private _SubParsersAction
    """Add `bench` with its `serve`, `throughput` and `latency` subcommands to `pagoda`'s subparsers."""
    bench = commands.add_parser("bench", help="benchmark a server or the engine (as `vllm bench`)")
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="{serve,throughput,latency}")
    formatter = argparse.ArgumentDefaultsHelpFormatter
    serve = kinds.add_parser(
        "serve",
        help="a running OpenAI-compatible server under load: throughput, TTFT, TPOT, ITL",
        formatter_class=formatter,
    )
    _serve_flags(serve)
    serve.set_defaults(run=_run_serve, parser=serve)
    throughput = kinds.add_parser(
        "throughput",
        help="offline throughput of the engine (LLM.generate) on random prompts",
        formatter_class=formatter,
    )
    _offline_flags(throughput, input_len=1024, output_len=128)
    throughput.add_argument("--num-prompts", type=positive_int, default=1000, help="requests in the workload")
    throughput.add_argument(
        "--dataset-name", choices=("random",), default="random", help="random token-id prompts"
    )
    throughput.add_argument(
        "--random-range-ratio", type=range_ratio, default=0.0, help="lengths uniform in len * (1 +- ratio)"
    )
    throughput.set_defaults(run=_run_throughput, parser=throughput)
    latency = kinds.add_parser(
        "latency",
        help="the latency of one batch generated offline, over repeated iterations",
        formatter_class=formatter,
    )
    _offline_flags(latency, input_len=32, output_len=128)
    latency.add_argument("--batch-size", type=positive_int, default=8, help="prompts per iteration")
    latency.add_argument(
        "--num-iters-warmup", type=non_negative_int, default=10, help="untimed iterations first"
    )
    latency.add_argument("--num-iters", type=positive_int, default=30, help="timed iterations")
    latency.set_defaults(run=_run_latency, parser=latency)


def _serve_flags(parser: argparse.ArgumentParser) -> None:
    """`vllm bench serve`'s flags (those that apply to an OpenAI-compatible server)."""
    target = parser.add_argument_group("server")
    target.add_argument("--base-url", default=None, help="the server's root URL (default: http://HOST:PORT)")
    target.add_argument("--host", default="127.0.0.1")
    target.add_argument("--port", type=positive_int, default=8000)
    target.add_argument(
        "--backend", choices=tuple(BACKEND_ENDPOINTS), default="vllm", help="the request format"
    )
    target.add_argument(
        "--endpoint", choices=ENDPOINTS, default=None, help="the API path (default: the backend's)"
    )
    target.add_argument(
        "--model", default=None, help="the model name to send (default: the first that /v1/models lists)"
    )
    target.add_argument("--served-model-name", default=None, help="send this name instead of --model")
    target.add_argument("--api-key", default=None, help="the server's --api-key (default: $OPENAI_API_KEY)")
    target.add_argument(
        "--ready-check-timeout-sec",
        type=non_negative_int,
        default=600,
        help="wait this long for the server's /v1/models to answer before starting",
    )
    data = parser.add_argument_group("dataset")
    data.add_argument(
        "--dataset-name",
        choices=("random", "sharegpt", "prefix_repetition"),
        default="random",
        help="random: prompts of common English words (about a token each; the server's usage counts the real "
        "tokens); sharegpt: --dataset-path's conversations; prefix_repetition: shared prefixes + suffixes",
    )
    data.add_argument(
        "--dataset-path", default=None, help="the ShareGPT JSON file of --dataset-name sharegpt"
    )
    data.add_argument("--num-prompts", type=positive_int, default=1000)
    data.add_argument("--random-input-len", type=positive_int, default=1024)
    data.add_argument("--random-output-len", type=positive_int, default=128)
    data.add_argument("--random-range-ratio", type=range_ratio, default=0.0)
    data.add_argument(
        "--sharegpt-output-len", type=positive_int, default=None, help="cap each ShareGPT reply's max_tokens"
    )
    data.add_argument("--prefix-repetition-prefix-len", type=positive_int, default=256)
    data.add_argument("--prefix-repetition-suffix-len", type=positive_int, default=256)
    data.add_argument("--prefix-repetition-num-prefixes", type=positive_int, default=10)
    data.add_argument("--prefix-repetition-output-len", type=positive_int, default=128)
    load = parser.add_argument_group("load and sampling")
    load.add_argument("--request-rate", type=request_rate, default=math.inf, help="Poisson arrivals, req/s")
    load.add_argument("--max-concurrency", type=positive_int, default=None, help="requests in flight at most")
    add_arrival_flags(load)
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--ignore-eos", action="store_true", help="every reply runs to its max_tokens")
    load.add_argument(
        "--temperature", type=temperature, default=None, help="default: send none (the server's)"
    )
    load.add_argument("--top-p", type=float, default=None)
    load.add_argument("--top-k", type=int, default=None)
    load.add_argument("--min-p", type=float, default=None)
    out = parser.add_argument_group("results")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    out.add_argument("--save-result", action="store_true", help="write the result JSON and a PNG")
    out.add_argument("--save-detailed", action="store_true", help="add every request's timings to the JSON")
    out.add_argument("--result-dir", default=".", help="where --save-result writes")
    out.add_argument("--result-filename", default=None, help="the JSON's name (the PNG takes its stem)")
    out.add_argument("--label", default=None, help="the run's name (default: the backend)")
    out.add_argument(
        "--metadata", nargs="*", type=key_value, default=[], metavar="KEY=VALUE", help="saved with the result"
    )
    out.add_argument(
        "--percentile-metrics", type=metric_names, default=("ttft", "tpot", "itl"), help="comma-separated"
    )
    out.add_argument("--metric-percentiles", type=percentiles, default=(99.0,), help="comma-separated")


def _offline_flags(parser: argparse.ArgumentParser, *, input_len: int, output_len: int) -> None:
    """The flags `bench throughput` and `bench latency` share, and the engine's."""
    parser.add_argument(
        "--input-len", "--random-input-len", dest="input_len", type=positive_int, default=input_len
    )
    parser.add_argument(
        "--output-len", "--random-output-len", dest="output_len", type=positive_int, default=output_len
    )
    parser.add_argument("--n", type=positive_int, default=1, help="samples per prompt")
    parser.add_argument("--output-json", default=None, help="write the result here (and a PNG of its stem)")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    add_engine_flags(parser)


def _run_serve(args: argparse.Namespace) -> int:
    """`pagoda bench serve`."""
    from pagoda.server.bench.serve_cli import run_serve

    return run_serve(args)


def _run_throughput(args: argparse.Namespace) -> int:
    """`pagoda bench throughput`."""
    from pagoda.server.bench.offline import run_throughput

    return run_throughput(args)


def _run_latency(args: argparse.Namespace) -> int:
    """`pagoda bench latency`."""
    from pagoda.server.bench.offline import run_latency

    return run_latency(args)
