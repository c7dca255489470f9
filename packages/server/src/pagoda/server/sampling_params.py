"""Per-request sampling parameters (vLLM's names and meanings)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pagoda.scheduler import RequestSLO
from pagoda.server.lora.request import LoRARequest
from pagoda.server.structured.params import StructuredOutputsParams

__all__ = ["MAX_LOGPROBS", "SamplingParams", "SamplingParamsError", "StructuredOutputsParams"]
from pagoda.server.beam_search import BeamSearchParams
from pagoda.server.pooling.params import PoolingParams

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: a bias in [-100, 100] is added to the token's logit


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; `param` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request: temperature 0 is greedy; None disables top_k, seed and logprobs."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top alternatives per sampled token (0: the sampled token's logprob only)
    skip_special_tokens: bool = True
    priority: int = 0  # lower runs first under the priority policy (vLLM's convention)
    slo: RequestSLO | None = None  # its own TTFT / TPOT objectives (None: its class's, --slo-ttft-ms ...)
    speculative: bool = True  # False: never drafted, whatever --speculative-config says
    structured_outputs: StructuredOutputsParams | None = None  # a JSON schema, regex, choice or grammar
    # Logits processing before the sampler (vLLM's names): a bias added to the listed ids' logits, the only ids
    # that may be sampled, and words never to complete. Logprobs stay those of the raw model distribution.
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: Sequence[int] | None = None
    bad_words: Sequence[str] | None = None
    prompt_logprobs: int | None = None  # top alternatives per prompt position (0: the prompt token's only)
    # Beam search instead of sampling: n (<= beam_width) best beams are returned, nothing is streamed.
    beam_search: BeamSearchParams | None = None
    # Prefix-cache isolation (vLLM's `cache_salt`): only requests with the same salt share cached blocks.
    cache_salt: str | None = None
    # An embedding request (the pooling runner): prefill only, its prompt pooled into one vector; nothing sampled.
    pooling: PoolingParams | None = None
    # bad_words as token sequences (logits_processors.tokenize_bad_words), filled by the API at admission so that
    # the engine thread does not tokenize; None: the engine tokenizes bad_words itself (vLLM's _bad_words_token_ids).
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None
    # The LoRA adapter the request runs under (the API sets it from `model`; offline: generate's lora_request).
    lora_request: LoRARequest | None = None

    def __post_init__(self) -> None:
        """Reject out-of-range values with an error naming the field."""
        checks: list[tuple[bool, str, str]] = [
            (self.n >= 1, "n", "n must be at least 1"),
            (
                math.isfinite(self.temperature) and self.temperature >= 0,
                "temperature",
                "temperature must be >= 0",
            ),
            (0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]"),
            (self.top_k is None or self.top_k >= 1, "top_k", "top_k must be at least 1 (or None to disable)"),
            (0.0 <= self.min_p <= 1.0, "min_p", "min_p must be in [0, 1]"),
            (
                0.0 < self.repetition_penalty <= 2.0,
                "repetition_penalty",
                "repetition_penalty must be in (0, 2]",
            ),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "presence_penalty must be in [-2, 2]"),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                "frequency_penalty",
                "frequency_penalty must be in [-2, 2]",
            ),
            (self.max_tokens >= 1, "max_tokens", "max_tokens must be at least 1"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens", "min_tokens must be in [0, max_tokens]"),
            (all(self.stop), "stop", "stop strings must not be empty"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "stop_token_ids must be >= 0"),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"logprobs must be in [0, {MAX_LOGPROBS}]",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                "prompt_logprobs",
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]",
            ),
            (
                all(
                    math.isfinite(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS
                    for b in (self.logit_bias or {}).values()
                ),
                "logit_bias",
                f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            ),
            (all(t >= 0 for t in self.logit_bias or {}), "logit_bias", "logit_bias token ids must be >= 0"),
            (
                self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
                "allowed_token_ids",
                "allowed_token_ids must not be empty",
            ),
            (
                all(t >= 0 for t in self.allowed_token_ids or ()),
                "allowed_token_ids",
                "allowed_token_ids must be >= 0",
            ),
            (all(w.strip() for w in self.bad_words or ()), "bad_words", "bad_words must not be blank"),
            (
                self.bad_words_token_ids is None
                or (self.bad_words is not None and all(t >= 0 for w in self.bad_words_token_ids for t in w)),
                "bad_words",
                "bad_words_token_ids are the tokens of bad_words (ids >= 0)",
            ),
        ]
        beam = self.beam_search
        if beam is not None:
            checks += [
                (self.n <= beam.beam_width, "n", "n must be at most the beam width"),
                (self.max_tokens == beam.max_tokens, "max_tokens", "max_tokens must equal the beam's"),
                (self.ignore_eos == beam.ignore_eos, "ignore_eos", "ignore_eos must equal the beam's"),
            ]
            # Beams are scored on the raw log-probabilities (transformers' beam search): logits processing and
            # grammars would be ignored silently, so they are refused.
            checks += [
                (getattr(self, name) is None, name, f"{name} is not supported with beam search")
                for name in (
                    "structured_outputs",
                    "logit_bias",
                    "allowed_token_ids",
                    "bad_words",
                    "prompt_logprobs",
                )
            ]
        for ok, param, message in checks:
            if not ok:
                raise SamplingParamsError(param, message)

    @classmethod
    def for_beam_search(
        cls, beam: BeamSearchParams, n: int | None = None, **fields: object
    ) -> SamplingParams:
        """Parameters that run `beam` and return its `n` best beams (default: all of them)."""
        return cls(
            n=beam.beam_width if n is None else n,
            temperature=0.0,
            max_tokens=beam.max_tokens,
            ignore_eos=beam.ignore_eos,
            beam_search=beam,
            **fields,  # type: ignore[arg-type]
        )

    @property
    def num_sequences(self) -> int:
        """Sequences one prompt holds in the engine: its n samples, or the beam width of a beam search."""
        return self.n if self.beam_search is None else max(self.n, self.beam_search.beam_width)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0
