"""`pagoda bench serve`: the serving benchmark (`pagoda.server.bench.serving`) under `vllm bench serve`'s flags,
its printed result and its result JSON (`--save-result`, with a PNG of the latency CDFs and throughput beside it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from pagoda.server.bench import serving
from pagoda.server.bench.args import BACKEND_ENDPOINTS

_WIDTH = 50  # vLLM's result block


def run_serve(args: argparse.Namespace) -> int:
    """Run the benchmark against the server; print vLLM's result block; 0 when every request succeeded."""
    if args.dataset_name == "sharegpt" and args.dataset_path is None:
        args.parser.error("--dataset-name sharegpt needs --dataset-path")
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/").removesuffix("/v1")
    api_key = args.api_key if args.api_key is not None else os.environ.get("OPENAI_API_KEY")
    try:
        listed = wait_for_models(base_url, api_key, args.ready_check_timeout_sec)
    except RuntimeError as exc:
        print(f"pagoda bench serve: {exc}", file=sys.stderr)
        return 1
    model = args.served_model_name or args.model or listed
    endpoint = args.endpoint or BACKEND_ENDPOINTS[args.backend]
    bench_args = serving.parse_args(tool_argv(args, base_url, model, endpoint, api_key))
    run = serving.run_all(bench_args)[0]
    print(result_block(run, args))
    for error in run["errors"]:
        print(f"error: {error}", file=sys.stderr)
    if args.save_result:
        path = save_result(run, args, model)
        try:
            serving.plot([run], path.with_suffix(".png"))
        except ImportError:
            print("no PNG: matplotlib is not installed (pip install 'pagoda-server[bench]')", file=sys.stderr)
        else:
            print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0 if run["failed"] == 0 else 1


def wait_for_models(base_url: str, api_key: str | None, timeout: float) -> str:
    """The first model id /v1/models lists, polled until it answers (at most `timeout` s); RuntimeError."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout
    while True:
        try:
            response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=10)
            if response.status_code == 200 and response.json().get("data"):
                return str(response.json()["data"][0]["id"])
            problem = f"answered {response.status_code}: {response.text[:200]}"
        except httpx.HTTPError as exc:
            problem = f"does not answer ({exc})"
        if time.monotonic() >= deadline:
            raise RuntimeError(f"{base_url}/v1/models {problem}")
        time.sleep(1.0)


def tool_argv(
    args: argparse.Namespace, base_url: str, model: str, endpoint: str, api_key: str | None
) -> list[str]:
    """The serving benchmark's own command line for vLLM's flags (no settling wait: one server, one run)."""
    argv = [
        "--base-url", base_url, "--model", model, "--endpoint", endpoint,
        "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
        "--seed", str(args.seed), "--settle", "0", "--label", args.label or model,
    ]  # fmt: skip
    if args.dataset_name == "random":
        argv += ["--input-len", str(args.random_input_len), "--output-len", str(args.random_output_len)]
        argv += ["--range-ratio", str(args.random_range_ratio)]
    elif args.dataset_name == "sharegpt":
        # Each reply's max_tokens is its recorded length in words, capped by --sharegpt-output-len.
        argv += ["--dataset", "sharegpt", "--dataset-path", args.dataset_path]
        argv += ["--output-len", str(args.sharegpt_output_len or 1 << 20)]
    else:  # prefix_repetition: the shared-prefix workload
        argv += ["--dataset", "shared-prefix", "--num-prefixes", str(args.prefix_repetition_num_prefixes)]
        argv += ["--prefix-len", str(args.prefix_repetition_prefix_len)]
        argv += ["--input-len", str(args.prefix_repetition_suffix_len)]
        argv += ["--output-len", str(args.prefix_repetition_output_len), "--range-ratio", "0"]
    for flag in ("max_concurrency", "temperature", "top_p", "top_k", "min_p"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    argv += ["--burstiness", str(args.burstiness)]
    if args.goodput:
        argv += ["--goodput", *(f"{name}:{ms:g}" for name, ms in args.goodput)]
    if args.ignore_eos:
        argv.append("--ignore-eos")
    if args.disable_tqdm:
        argv.append("--disable-tqdm")
    if api_key:
        argv += ["--api-key", api_key]
    return argv


def metric_values(run: dict[str, Any]) -> dict[str, list[float]]:
    """Each metric's samples in ms: TTFT and E2E latency per request, TPOT per request of 2+ tokens, every ITL."""
    done = [r for r in run["requests"] if r["success"]]
    return {
        "ttft": [r["ttft"] * 1e3 for r in done],
        "tpot": [
            (r["latency"] - r["ttft"]) * 1e3 / (r["output_tokens"] - 1)
            for r in done
            if r["output_tokens"] > 1
        ],
        "itl": [gap * 1e3 for r in done for gap in r["itl"]],
        "e2el": [r["latency"] * 1e3 for r in done],
    }


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile by linear interpolation between closest ranks (numpy's default, vLLM's)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = p / 100.0 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _p_name(p: float) -> str:
    """A percentile as vLLM's keys write it: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if p == int(p) else str(p)


def metric_stats(run: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    """mean, median, std and the --metric-percentiles of each --percentile-metrics metric, in vLLM's keys."""
    values = metric_values(run)
    stats: dict[str, float] = {}
    for name in args.percentile_metrics:
        samples = values[name]
        stats[f"mean_{name}_ms"] = statistics.fmean(samples) if samples else 0.0
        stats[f"median_{name}_ms"] = statistics.median(samples) if samples else 0.0
        stats[f"std_{name}_ms"] = statistics.pstdev(samples) if samples else 0.0
        for p in args.metric_percentiles:
            stats[f"p{_p_name(p)}_{name}_ms"] = percentile(samples, p)
    return stats


_SECTIONS = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def result_block(run: dict[str, Any], args: argparse.Namespace) -> str:
    """vLLM's printed result: the counts and throughputs, then each metric's mean, median and percentiles."""

    def row(title: str, value: object) -> str:
        return f"{title:<40} {value:<10}"

    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    lines = [f"{' Serving Benchmark Result ':=^{_WIDTH}}"]
    lines.append(row("Successful requests:", run["completed"]))
    lines.append(row("Failed requests:", run["failed"]))
    if args.max_concurrency is not None:
        lines.append(row("Maximum request concurrency:", args.max_concurrency))
    lines.append(row("Request rate configured (RPS):", rate))
    lines.append(row("Benchmark duration (s):", f"{run['duration_s']:.2f}"))
    lines.append(row("Total input tokens:", run["total_input_tokens"]))
    lines.append(row("Total generated tokens:", run["total_output_tokens"]))
    lines.append(row("Request throughput (req/s):", f"{run['request_throughput']:.2f}"))
    if run.get("request_goodput") is not None:
        lines.append(row("Request goodput (req/s):", f"{run['request_goodput']:.2f}"))
    lines.append(row("Output token throughput (tok/s):", f"{run['output_throughput']:.2f}"))
    lines.append(row("Total Token throughput (tok/s):", f"{run['total_token_throughput']:.2f}"))
    if run.get("prefix_cache_hit_rate") is not None:
        lines.append(row("Prefix cache hit rate:", f"{run['prefix_cache_hit_rate']:.1%}"))
    stats = metric_stats(run, args)
    for name in args.percentile_metrics:
        title, short = _SECTIONS[name]
        lines.append(f"{title:-^{_WIDTH}}")
        lines.append(row(f"Mean {short} (ms):", f"{stats[f'mean_{name}_ms']:.2f}"))
        lines.append(row(f"Median {short} (ms):", f"{stats[f'median_{name}_ms']:.2f}"))
        for p in args.metric_percentiles:
            lines.append(row(f"P{_p_name(p)} {short} (ms):", f"{stats[f'p{_p_name(p)}_{name}_ms']:.2f}"))
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def save_result(run: dict[str, Any], args: argparse.Namespace, model: str) -> Path:
    """Write the result JSON (vLLM's keys, plus Pagoda's prefix-cache counters) under --result-dir; its path."""
    now = datetime.now().strftime("%Y%m%d-%H%M%S")
    label = args.label or args.backend
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    result: dict[str, Any] = {
        "date": now,
        "backend": args.backend,
        "label": label,
        "model_id": model,
        "tokenizer_id": None,  # token counts come from the server's usage reports
        "num_prompts": args.num_prompts,
        "request_rate": rate,
        "burstiness": args.burstiness,
        "request_goodput": run.get("request_goodput"),
        "max_concurrency": args.max_concurrency,
        "duration": run["duration_s"],
        "completed": run["completed"],
        "failed": run["failed"],
        "total_input_tokens": run["total_input_tokens"],
        "total_output_tokens": run["total_output_tokens"],
        "request_throughput": run["request_throughput"],
        "output_throughput": run["output_throughput"],
        "total_token_throughput": run["total_token_throughput"],
        "prefix_cache_hit_rate": run["prefix_cache_hit_rate"],
        **metric_stats(run, args),
    }
    for item in args.metadata:
        key, _, value = item.partition("=")
        result[key] = value
    if args.save_detailed:
        requests = run["requests"]
        result.update(
            input_lens=[r["prompt_tokens"] for r in requests],
            output_lens=[r["output_tokens"] for r in requests],
            ttfts=[r["ttft"] for r in requests],
            itls=[r["itl"] for r in requests],
            errors=[r["error"] for r in requests],
        )
    concurrency = "" if args.max_concurrency is None else f"-concurrency{args.max_concurrency}"
    name = args.result_filename or f"{label}-{rate}qps{concurrency}-{Path(model).name}-{now}.json"
    path = Path(args.result_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return path
