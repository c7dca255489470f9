"""`Resume`: a request's sampled state handed from one engine to another (prefill/decode disaggregation).

A prefill core computes the prompt's KV and the first token; a decode core takes the request on with `Resume`
and continues it exactly as a request preempted by recompute continues: its outputs so far are part of its
sequence, the prefix cache (fed through the shared KV tier) supplies the blocks the prefill computed, and the
sampler's counter-based key (seed, sample index, output position) draws the same tokens the prefill core would
have drawn next. No torch here: the front end builds these.
"""

from __future__ import annotations

import msgspec
from pagoda.server.outputs import PositionLogprobs
from pagoda.server.sampling_params import SamplingParams


class Resume(msgspec.Struct, frozen=True):
    """What a request's one sample has produced so far, and the seed its draws are keyed by."""

    output_token_ids: list[int]
    seed: int  # the request's own seed, or the one the front end gave an unseeded request
    logprobs: list[PositionLogprobs] | None = None  # per output position, when the request asks for logprobs
    cumulative_logprob: float | None = None
    # The prefill core's KV block server (`kv_tiers/peer.py`) when this engine cannot read its host tier (another
    # host, `--kv-transfer tcp`); None: the blocks are in a tier this engine shares.
    kv_source: str | None = None


def can_resume(params: SamplingParams) -> bool:
    """Whether a request may move between engines mid-generation: one plain sample, no prompt scores."""
    return (
        params.n == 1
        and params.beam_search is None
        and params.pooling is None
        and params.prompt_logprobs is None
    )
