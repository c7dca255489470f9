"""vLLM's beam-search fields of /v1/completions (`use_beam_search`, `best_of`, `length_penalty`,
`early_stopping`) turned into the engine's `SamplingParams.beam_search`, with a 400 for each bad combination."""

from __future__ import annotations

import dataclasses

from pagoda.server.api.errors import bad_request
from pagoda.server.api.protocol import CompletionRequest
from pagoda.server.beam_search import BeamSearchParams
from pagoda.server.sampling_params import SamplingParams, SamplingParamsError

# The request fields this module serves (SamplingFields declares them for the endpoints that do not).
BEAM_FIELDS = frozenset({"use_beam_search", "best_of", "length_penalty", "early_stopping"})


def with_beam_search(body: CompletionRequest, params: SamplingParams) -> SamplingParams:
    """`params` with beam search when the body asks for it; a 400 naming the field that does not combine."""
    if not body.use_beam_search:
        for field, unset in (
            ("length_penalty", body.length_penalty == 1.0),
            ("early_stopping", not body.early_stopping),
        ):
            if not unset:
                raise bad_request(f"{field} applies to beam search only (set use_beam_search)", field)
        if body.best_of is not None and body.best_of != body.n:
            raise bad_request("best_of other than n is supported with use_beam_search only", "best_of")
        return params
    # Beam search is deterministic and returns whole sequences: sampling, streaming and per-token fields
    # have no meaning for it, and silently ignoring them would answer a different question.
    conflicts = (
        ("stream", body.stream),
        ("logprobs", body.logprobs is not None),
        ("stop", bool(body.stop)),
        ("temperature", body.temperature not in (None, 0.0)),
        ("min_tokens", body.min_tokens != 0),
        ("echo", body.echo),
    )
    for field, present in conflicts:
        if present:
            raise bad_request(f"{field} is not supported with use_beam_search", field)
    width = body.n if body.best_of is None else body.best_of
    if body.n > width:
        raise bad_request(f"n ({body.n}) must be at most best_of, the beam width ({width})", "n")
    beam = BeamSearchParams(
        beam_width=width,
        max_tokens=params.max_tokens,
        ignore_eos=params.ignore_eos,
        length_penalty=body.length_penalty,
        early_stopping=body.early_stopping,
    )
    try:
        return dataclasses.replace(params, temperature=0.0, beam_search=beam)
    except SamplingParamsError as exc:
        raise bad_request(str(exc), exc.param) from exc
