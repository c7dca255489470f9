"""`pagoda bench throughput` and `pagoda bench latency`: the engine offline (`LLM.generate`), as vLLM's.

Both draw random token-id prompts (fixed by --seed) and sample as vLLM's do (temperature 1.0, top_p 1.0, EOS
ignored, so every request computes its --output-len tokens). One tiny generation runs first, untimed, so that
first-call costs (kernel builds, first allocations) stay out of the numbers. `--output-json` writes vLLM's keys
and a PNG beside it (its stem, .png).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from pagoda.server.bench.engine_flags import engine_kwargs
from pagoda.server.bench.plots import plot_latency, plot_throughput
from pagoda.server.bench.workload import length_range, make_workload

LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)  # what vLLM's latency benchmark prints
_WARMUP_TOKENS = 4


def run_throughput(args: argparse.Namespace) -> int:
    """Generate --num-prompts requests at once; print and (--output-json) save requests/s and tokens/s."""
    from pagoda.server.llm import LLM
    from pagoda.server.sampling_params import SamplingParams

    kwargs = engine_kwargs(args, args.parser)
    llm = LLM(**kwargs)
    vocab = _prompt_vocabulary(llm)
    workload = make_workload(
        args.num_prompts,
        length_range(args.input_len, args.random_range_ratio),
        length_range(args.output_len, args.random_range_ratio),
        vocab,
        kwargs.get("seed", 0),
    )
    _warm_up(llm, workload.prompts[0])
    params = [
        SamplingParams(n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=length)
        for length in workload.output_lens
    ]
    started, started_monotonic = time.perf_counter(), time.monotonic()
    outputs = llm.generate([list(p) for p in workload.prompts], params, use_tqdm=not args.disable_tqdm)
    elapsed = time.perf_counter() - started
    output_tokens = sum(len(sample.token_ids) for out in outputs for sample in out.outputs)
    total_tokens = workload.prompt_tokens + output_tokens
    print(
        f"Throughput: {len(outputs) / elapsed:.2f} requests/s, {total_tokens / elapsed:.2f} total tokens/s, "
        f"{output_tokens / elapsed:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {workload.prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    if args.output_json is None:
        return 0
    result: dict[str, Any] = {
        "model": llm.engine.model_name,
        "elapsed_time": elapsed,
        "num_requests": len(outputs),
        "total_num_tokens": total_tokens,
        "total_prompt_tokens": workload.prompt_tokens,
        "total_output_tokens": output_tokens,
        "requests_per_second": len(outputs) / elapsed,
        "tokens_per_second": total_tokens / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
    }
    path = _write_json(args.output_json, result)
    finished = [out.metrics.finished_time for out in outputs if out.metrics.finished_time is not None]
    latencies = [out.metrics.latency for out in outputs if out.metrics.latency is not None]
    title = f"{llm.engine.model_name}: {len(outputs)} requests, {args.input_len} in / {args.output_len} out"
    if plot_throughput([t - started_monotonic for t in finished], latencies, title, path.with_suffix(".png")):
        print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


def run_latency(args: argparse.Namespace) -> int:
    """Time --num-iters generations of one batch (after --num-iters-warmup untimed ones); print the mean and
    percentiles, and (--output-json) save them."""
    import numpy as np
    from pagoda.server.llm import LLM
    from pagoda.server.sampling_params import SamplingParams
    from tqdm import tqdm

    kwargs = engine_kwargs(args, args.parser)
    llm = LLM(**kwargs)
    rng = random.Random(kwargs.get("seed", 0))
    vocab = _prompt_vocabulary(llm)
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.batch_size)]
    params = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len)
    _warm_up(llm, tuple(prompts[0]))
    for _ in tqdm(range(args.num_iters_warmup), desc="Warmup iterations", disable=args.disable_tqdm):
        llm.generate(prompts, params, use_tqdm=False)
    latencies: list[float] = []
    for _ in tqdm(range(args.num_iters), desc="Profiling iterations", disable=args.disable_tqdm):
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        latencies.append(time.perf_counter() - started)
    values = np.percentile(latencies, LATENCY_PERCENTILES)  # linear interpolation, as vLLM's
    print(f"Avg latency: {statistics.fmean(latencies)} seconds")
    for percentile, value in zip(LATENCY_PERCENTILES, values.tolist(), strict=True):
        print(f"{percentile}% percentile latency: {value} seconds")
    if args.output_json is None:
        return 0
    result = {
        "model": llm.engine.model_name,
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "avg_latency": statistics.fmean(latencies),
        "latencies": latencies,
        "percentiles": {str(p): v for p, v in zip(LATENCY_PERCENTILES, values.tolist(), strict=True)},
    }
    path = _write_json(args.output_json, result)
    title = f"{llm.engine.model_name}: batch {args.batch_size}, {args.input_len} in / {args.output_len} out"
    if plot_latency(latencies, title, path.with_suffix(".png")):
        print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


def _prompt_vocabulary(llm: Any) -> int:
    """Token ids a prompt may hold: those both the model and the tokenizer know (a model's vocabulary is often
    padded past its tokenizer's)."""
    return int(min(llm.engine.vocab_size, len(llm.tokenizer)))


def _warm_up(llm: Any, prompt: tuple[int, ...]) -> None:
    """One tiny untimed generation: the first call's one-time costs stay out of the timed ones."""
    from pagoda.server.sampling_params import SamplingParams

    params = SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=_WARMUP_TOKENS)
    llm.generate([list(prompt[:8])], params, use_tqdm=False)


def _write_json(name: str, result: dict[str, Any]) -> Path:
    """Write `result` to `name` (its folder created); the path."""
    path = Path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return path
