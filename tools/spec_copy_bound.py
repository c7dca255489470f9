"""How much can drafts taken from the prompt gain when sampling? The model's own probability of repeating the text.

    python tools/spec_copy_bound.py                     # Gemma 3 270M, bench_spec's repeat and code_edit prompts
    python tools/spec_copy_bound.py --tiny              # a tiny random model (smoke)

An exact rejection sampler accepts a model-free draft (ngram, suffix: a point mass) with probability p(draft), the
target's probability of that token at temperature 1.0. For bench_spec.py's workloads whose answer repeats the
prompt, this tool feeds the prompt followed by the text it asks to repeat (`repeat`: the text itself; `code_edit`:
the source file, unedited) and reads each copied token's probability (prompt logprobs, one forward pass): the
best case for any proposer, drafts being exactly the text. It prints, per workload, the mean and median p over
the copied tokens, the first few (where a sample leaves the text or not), the chance a temperature-1.0 sample
copies the first n tokens, and the expected tokens per verification step with perfect drafts of length k while
the sample is still on the text (1 + p1 + p1 p2 + ...). Greedy decoding copies whenever the text's token is the
argmax, which the last column counts.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench_spec import workloads
from pagoda.server.llm import LLM
from pagoda.server.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class CopyBound:
    """One workload's probabilities of copying its text, under teacher forcing."""

    workload: str
    num_tokens: int  # copied tokens scored
    mean_p: float
    median_p: float
    first_p: tuple[float, ...]  # the first five copied tokens' probabilities
    p_copy_first: dict[int, float]  # n -> probability that a temperature-1.0 sample copies the first n tokens
    tokens_per_step: dict[int, float]  # k -> expected tokens per verify step, perfect drafts of length k
    argmax_fraction: float  # copied tokens that are the argmax (what greedy decoding repeats)


def expected_tokens_per_step(probabilities: Sequence[float], k: int) -> float:
    """Mean over the positions of 1 + p1 + p1 p2 + ... + p1..pk: accepted drafts plus the token drawn after them."""
    starts = range(max(1, len(probabilities) - k))
    total = 0.0
    for start in starts:
        run, expected = 1.0, 1.0
        for p in probabilities[start : start + k]:
            run *= p
            expected += run
        total += expected
    return total / len(starts)


def copy_bound(llm: LLM, name: str, prompt: Sequence[int], text: Sequence[int]) -> CopyBound:
    """Score `text` after `prompt` (teacher forcing): each text token's probability given everything before it."""
    full = [*prompt, *text]
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=1.0)
    output = llm.generate([full], params, use_tqdm=False)[0]
    assert output.prompt_logprobs is not None
    probabilities: list[float] = []
    argmax = 0
    for position in range(len(prompt), len(full)):
        entry = output.prompt_logprobs[position]
        assert entry is not None
        token = full[position]
        probabilities.append(math.exp(entry[token].logprob))
        argmax += entry[token].rank == 1
    return CopyBound(
        workload=name,
        num_tokens=len(probabilities),
        mean_p=statistics.mean(probabilities),
        median_p=statistics.median(probabilities),
        first_p=tuple(round(p, 3) for p in probabilities[:5]),
        p_copy_first={n: math.prod(probabilities[:n]) for n in (1, 5, 20) if n <= len(probabilities)},
        tokens_per_step={k: expected_tokens_per_step(probabilities, k) for k in (2, 4, 8)},
        argmax_fraction=argmax / len(probabilities),
    )


def table(bounds: Sequence[CopyBound]) -> str:
    """One row per workload."""
    lines = [
        f"{'workload':10} {'tokens':>6} {'mean p':>7} {'median':>7} {'first five p':34} {'P(copy 1/5/20)':22}"
        f" {'tok/step k=2/4/8':18} {'argmax':>6}"
    ]
    for b in bounds:
        copies = "/".join(f"{p:.3f}" for p in b.p_copy_first.values())
        steps = "/".join(f"{t:.2f}" for t in b.tokens_per_step.values())
        first = ", ".join(f"{p:.2f}" for p in b.first_p)
        lines.append(
            f"{b.workload:10} {b.num_tokens:6} {b.mean_p:7.3f} {b.median_p:7.3f} {first:34} {copies:22}"
            f" {steps:18} {b.argmax_fraction:6.2f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[CopyBound]:
    """Score the copy workloads; print the table."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m", help="HF folder, .gguf or packaged short name")
    parser.add_argument("--tiny", action="store_true", help="a tiny random-weight llama (smoke runs)")
    parser.add_argument("--quantization", default=None, help="the engine's --quantization")
    parser.add_argument("--max-prompt-tokens", type=int, default=512, help="as bench_spec.py's")
    parser.add_argument("--copy-tokens", type=int, default=200, help="text tokens scored after the prompt")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model
        extra: dict[str, str] = {} if args.quantization is None else {"quantization": args.quantization}
        if args.tiny:
            from pagoda.server.testing import make_tiny_model

            model = str(make_tiny_model("llama", Path(scratch) / "tiny"))
            extra["dtype"] = "float32"
        length = args.max_prompt_tokens + args.copy_tokens + 8
        llm = LLM(model, max_model_len=length, max_num_batched_tokens=length, **extra)
        prompts = workloads(llm.tokenizer, args.max_prompt_tokens, 0)
        bounds = []
        for name in ("repeat", "code_edit"):
            prompt = prompts[name]
            # The text the prompt asks to repeat: its own body (after BOS), as far as the prompt holds it.
            bos = (
                1 if llm.tokenizer.bos_token_id is not None and prompt[0] == llm.tokenizer.bos_token_id else 0
            )
            # (At most half the prompt, so that the instruction after the body is never part of the "text".)
            text = prompt[bos : bos + min(args.copy_tokens, (len(prompt) - bos) // 2)]
            bounds.append(copy_bound(llm, name, prompt, text))
        llm.engine.close()
    print(table(bounds))
    return bounds


if __name__ == "__main__":
    main(sys.argv[1:])
