"""Image benchmark: a vision-language model served over HTTP, as users send it images (the openai client's chat
completions with `image_url` data URLs, streamed).

Writes a random-weight VLM folder of realistic shape (`--arch`, the "small" size of `pagoda.server.testing`:
head_dim 64, 256 tokens per image; Llava's CLIP resizes to 224 px, Qwen2-VL takes 448 px), starts `pagoda serve` on it (and each `--peer` command on the same
folder), and measures, for each server:

- **one stream**: requests one after another, each with a new image: TTFT and images/s;
- **8 concurrent**: eight clients, each with new images: TTFT (median, p90) and images/s;
- **the prefix cache**: the same image and text again right after: TTFT with the hit against without;

at temperature 1.0 (the OpenAI default) and 0. Then, in this process, the engine alone on the same images splits a
request's time into the vision encoder and the language model. Prints one table (the CPU named) and writes a PNG:

    python tools/bench_images.py                                   # Pagoda only
    V=$(../shared/peers/vllm_cpu.sh); source $V/peer.env
    python tools/bench_images.py --peer "vllm=$V/bin/vllm serve {model} --port {port} --dtype bfloat16 \\
        --max-model-len 2048 --enforce-eager --served-model-name m"
    python tools/bench_images.py --tiny --dtype float32 --requests 1 --concurrency 1 --repeats 1 \\
        --max-tokens 1 --temperatures 0 --encoder-images 1     # a smoke run: seconds, numbers meaningless

`--tiny` writes the tests' tiny model of `--arch` instead of the small one (16 tokens per Llava image, a 256-token
context); `--dtype` is Pagoda's (`pagoda serve` and the engine alone), `--encoder-images` the images of the engine
alone.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import httpx
import numpy as np
import openai
from pagoda.pagedkernel.cbuild import cpu_name
from pagoda.server.config import DTypeName
from pagoda.server.testing import free_port
from pagoda.server.testing.serve import LiveServer
from pagoda.server.testing.tiny_qwen_vl import make_tiny_qwen_vl
from pagoda.server.testing.tiny_vlm import make_tiny_vlm
from PIL import Image
from safetensors.torch import load_file, save_file
from tqdm import tqdm

QUESTION = "Describe this picture in one sentence."
IMAGE_SIZE = 448


def picture(seed: int) -> Image.Image:
    """A random RGB picture (no two seeds alike: every request is a cache miss unless repeated on purpose)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def data_url(image: Image.Image) -> str:
    """A PNG data URL, as a client sends a local picture."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@dataclass(slots=True)
class Timing:
    """One request: time to its first token and to its end."""

    ttft: float
    total: float


@dataclass(slots=True)
class Result:
    """One server's numbers at one temperature."""

    label: str
    temperature: float
    single: list[Timing] = field(default_factory=list)
    single_s: float = 0.0
    concurrent: list[Timing] = field(default_factory=list)
    concurrent_s: float = 0.0
    miss: list[float] = field(default_factory=list)
    hit: list[float] = field(default_factory=list)


async def one_request(
    client: openai.AsyncOpenAI, model: str, url: str, max_tokens: int, temperature: float
) -> Timing:
    """A streamed chat completion with one image; its timings."""
    start = time.perf_counter()
    first: float | None = None
    stream = await client.chat.completions.create(
        model=model,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
        max_tokens=max_tokens,
        temperature=temperature,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
    total = time.perf_counter() - start
    return Timing(total if first is None else first, total)


async def measure(
    label: str, base_url: str, temperature: float, args: argparse.Namespace, seeds: list[int]
) -> Result:
    """Every scenario against one server, with images of `seeds` (consumed in order: never repeated)."""
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", timeout=600)
    model = (await client.models.list()).data[0].id
    result = Result(label, temperature)
    urls = iter([data_url(picture(seed)) for seed in seeds])
    await one_request(client, model, next(urls), 2, temperature)  # warm-up
    bar = tqdm(total=args.requests * 2 + args.repeats, desc=f"{label} t={temperature}", file=sys.stderr)
    start = time.perf_counter()
    for _ in range(args.requests):
        result.single.append(await one_request(client, model, next(urls), args.max_tokens, temperature))
        bar.update()
    result.single_s = time.perf_counter() - start

    async def client_loop(count: int) -> None:
        for _ in range(count):
            result.concurrent.append(
                await one_request(client, model, next(urls), args.max_tokens, temperature)
            )
            bar.update()

    start = time.perf_counter()
    per_client = [args.requests // args.concurrency] * args.concurrency
    per_client[0] += args.requests - sum(per_client)
    await asyncio.gather(*(client_loop(n) for n in per_client))
    result.concurrent_s = time.perf_counter() - start
    for _ in range(args.repeats):
        url = next(urls)
        result.miss.append((await one_request(client, model, url, 1, temperature)).ttft)
        result.hit.append((await one_request(client, model, url, 1, temperature)).ttft)
        bar.update()
    bar.close()
    return result


def encoder_split(folder: Path, count: int, **engine_args: Any) -> tuple[float, float]:
    """The engine alone on `count` new images (prompt + one token each, one at a time): seconds in the vision
    encoder and seconds in everything else (the language model's prefill, sampling)."""
    from pagoda.server.llm import LLM
    from pagoda.server.multimodal.registry import processor_for
    from pagoda.server.sampling_params import SamplingParams
    from transformers import AutoConfig, AutoTokenizer

    processor = processor_for(folder, AutoConfig.from_pretrained(folder))
    assert processor is not None
    llm = LLM(str(folder), **engine_args)
    engine = llm.engine
    assert engine.images is not None
    tokenizer = AutoTokenizer.from_pretrained(folder)
    content: Any = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    assert isinstance(text, str)
    total = 0.0
    for index in range(count + 1):
        prompt = processor.process(text, [picture(10_000 + index)], add_special_tokens=False)
        before = engine.images.encode_seconds
        start = time.perf_counter()
        engine.add_request(
            str(index), prompt.token_ids, SamplingParams(max_tokens=1), multi_modal=prompt.multi_modal
        )
        while engine.has_unfinished_requests():
            engine.step()
        if index:  # the first is a warm-up
            total += time.perf_counter() - start
        else:
            engine.images.encode_seconds = before
    encoder = engine.images.encode_seconds - before
    return encoder, total - encoder


def _p(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def table(results: list[Result], split: tuple[float, float], count: int, args: argparse.Namespace) -> str:
    """The results as one Markdown table, the machine named."""
    load = os.getloadavg()
    lines = [
        f"{args.arch} {'tiny' if args.tiny else 'small'} (random weights, {IMAGE_SIZE} px PNGs sent), "
        f"{args.max_tokens} output tokens; {cpu_name()}, {os.cpu_count()} CPUs, load {load[0]:.2f}",
        "",
        "| server | temp | 1 stream TTFT ms (median) | 1 stream images/s | 8 concurrent TTFT ms (median / p90) "
        "| 8 concurrent images/s | TTFT miss ms | TTFT cache hit ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        ttft1 = statistics.median(t.ttft for t in r.single) * 1000
        ttft8 = [t.ttft * 1000 for t in r.concurrent]
        lines.append(
            f"| {r.label} | {r.temperature:g} | {ttft1:.0f} | {len(r.single) / r.single_s:.2f} "
            f"| {statistics.median(ttft8):.0f} / {_p(ttft8, 0.9):.0f} | {len(r.concurrent) / r.concurrent_s:.2f} "
            f"| {statistics.median(r.miss) * 1000:.0f} | {statistics.median(r.hit) * 1000:.0f} |"
        )
    encoder, rest = split
    lines += [
        "",
        f"Pagoda's engine alone, {count} images one at a time (prompt + 1 token): vision encoder "
        f"{encoder / count * 1000:.0f} ms per image, language model and the rest {rest / count * 1000:.0f} ms "
        f"({encoder / (encoder + rest):.0%} in the encoder).",
    ]
    return "\n".join(lines)


def plot(results: list[Result], path: Path) -> None:
    """TTFT per scenario and server (bars), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = ("1 stream", "8 concurrent", "cache miss", "cache hit")
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(results))
    for index, r in enumerate(results):
        values = [
            statistics.median(t.ttft for t in r.single) * 1000,
            statistics.median(t.ttft for t in r.concurrent) * 1000,
            statistics.median(r.miss) * 1000,
            statistics.median(r.hit) * 1000,
        ]
        xs = [x + index * width for x in range(len(scenarios))]
        ax.bar(xs, values, width, label=f"{r.label} t={r.temperature:g}")
    ax.set_xticks([x + width * (len(results) - 1) / 2 for x in range(len(scenarios))], scenarios)
    ax.set_ylabel("TTFT, ms (median)")
    ax.set_title(f"Images: time to first token ({cpu_name()})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's options."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", default="llava", choices=["llava", "qwen2_vl", "qwen2_5_vl"])
    parser.add_argument("--requests", type=int, default=16, help="requests per scenario")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=4, help="cache miss / hit pairs")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperatures", default="1.0,0", help="comma-separated")
    parser.add_argument("--serve-arg", action="append", default=[], help="a flag for `pagoda serve` (repeat)")
    parser.add_argument("--peer", action="append", default=[], help="LABEL=COMMAND with {port} and {model}")
    parser.add_argument("--png", type=Path, default=Path("bench-images.png"))
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny model instead of the small one")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=get_args(DTypeName),
        help="Pagoda's (the server's and the engine's)",
    )
    parser.add_argument("--encoder-images", type=int, default=4, help="images of the engine alone")
    args = parser.parse_args(argv)
    if min(args.requests, args.concurrency, args.repeats, args.max_tokens, args.encoder_images) < 1:
        parser.error("--requests, --concurrency, --repeats, --max-tokens and --encoder-images must be >= 1")
    args.temperature_list = [float(t) for t in args.temperatures.split(",")]
    return args


def make_model(arch: str, path: Path, small: bool = True) -> Path:
    """The small (or, not `small`, the tests' tiny) random-weight model folder of `arch`. Llava's is saved in the
    hub's layout (`vision_tower.vision_model.*`, as llava-hf checkpoints are), which vLLM loads and transformers 5
    no longer writes."""
    if arch != "llava":
        return make_tiny_qwen_vl(arch, path, small=small)
    make_tiny_vlm("llava", path, small=small)
    weights = path / "model.safetensors"
    tensors = load_file(weights)
    prefix = "vision_tower."
    renamed = {
        (f"{prefix}vision_model.{name[len(prefix) :]}" if name.startswith(prefix) else name): tensor
        for name, tensor in tensors.items()
    }
    save_file(renamed, weights, metadata={"format": "pt"})
    return path


def wait_healthy(base_url: str, process: subprocess.Popen[bytes], timeout: float = 600) -> None:
    """Poll /health until 200 (RuntimeError if the peer exits first or the timeout passes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the peer exited with {process.returncode}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the peer did not become healthy")


def main(argv: list[str] | None = None) -> int:
    """Run every server through every scenario; print the table; write the PNG."""
    args = parse_args(argv)
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="bench-images-") as scratch:
        folder = make_model(args.arch, Path(scratch) / args.arch, small=not args.tiny)
        max_model_len = 256 if args.tiny else 2048  # the tiny models' positions
        seeds = iter(range(1_000_000))

        def run_all(label: str, base_url: str) -> None:
            for temperature in args.temperature_list:
                batch = [next(seeds) for _ in range(2 * args.requests + args.repeats + 1)]
                results.append(asyncio.run(measure(label, base_url, temperature, args, batch)))

        flags = ["--max-model-len", str(max_model_len), "--dtype", args.dtype, *args.serve_arg]
        server = LiveServer(folder, flags, ready_timeout=600)
        try:
            run_all("pagoda", server.base_url)
        finally:
            server.stop()
        for peer in args.peer:
            label, _, command = peer.partition("=")
            port = free_port()
            cmd = shlex.split(command.format(port=port, model=folder))
            process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                wait_healthy(f"http://127.0.0.1:{port}", process)
                run_all(label, f"http://127.0.0.1:{port}")
            finally:
                process.terminate()
                process.wait(timeout=60)
        count = args.encoder_images
        split = encoder_split(folder, count, max_model_len=max_model_len, dtype=args.dtype)
    print(table(results, split, count, args))
    plot(results, args.png)
    print(f"wrote {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
