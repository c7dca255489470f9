"""Which `EngineRequest` a request's parameters make, with the scheduler Request of its first sequence."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagoda.scheduler import EncoderSpan, Request
from pagoda.server.engine.beams import BeamGroup
from pagoda.server.engine.requests import RequestState, SchedulerParams
from pagoda.server.handoff import Resume
from pagoda.server.lora import LoRARequest
from pagoda.server.lora.salt import lora_salt
from pagoda.server.multimodal import MultiModalInputs
from pagoda.server.pooling.classifier import ScoreHead
from pagoda.server.pooling.params import PoolingParams
from pagoda.server.pooling.request import PoolingRequest
from pagoda.server.request_contract import EngineRequest, SamplesTokens
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.structured import StructuredOutputsParams
from transformers import PreTrainedTokenizerBase

if TYPE_CHECKING:  # xgrammar takes ~0.4 s to import: loaded at the first constrained request, not at start
    import xgrammar as xgr


@dataclass(frozen=True, slots=True)
class NewRequest:
    """A request as the engine takes it in: its EngineRequest, its scheduler Request, and what the engine's gates
    (`EngineExtension.hold`) read of it."""

    owner: EngineRequest
    request: Request  # what the scheduler gets: at once, or once every gate has released it
    # The constraint to compile, and what takes the compiled grammar; None: unconstrained.
    grammar: tuple[StructuredOutputsParams, Callable[[xgr.CompiledGrammar], None]] | None
    lora: LoRARequest | None = None  # the adapter it runs under; None: the base model
    multi_modal: MultiModalInputs | None = None  # its images (the image encoder takes them); None: text only
    kv_source: str | None = (
        None  # where the tiers pull its prompt's blocks from (a resumed request's prefill core)
    )


def new_request(
    request_id: str,
    prompt: str | None,
    prompt_token_ids: tuple[int, ...],
    params: SamplingParams,
    arrival: float,
    tokenizer: PreTrainedTokenizerBase,
    eos_token_ids: frozenset[int],
    seed: Callable[[SamplingParams], int],  # the request's RNG seed (the engine numbers unseeded requests)
    lora: LoRARequest | None = None,  # the adapter it runs under
    speculate: Callable[[RequestState], SamplesTokens]
    | None = None,  # drafts for plain rows (--speculative-config)
    score_head: ScoreHead
    | None = None,  # a sequence-classification model's head (the pooling runner's scores)
    multi_modal: MultiModalInputs | None = None,  # the prompt's images
    encoder_spans: Sequence[
        EncoderSpan
    ] = (),  # their placeholder spans, as the scheduler keys and chunks them
    resume: Resume | None = None,  # sample 0's outputs so far, drawn by another engine (a plain request's)
) -> NewRequest:
    """A pooling request for an embedding or a score, a beam group for a beam search, else a plain request
    (SamplingParams refuses grammars with beams), speculative under `speculate` unless constrained (grammar rows
    are never drafted) or opted out."""
    ids = prompt_token_ids
    if params.pooling is not None:
        head = score_head if params.pooling.task == "score" else None
        pooled = _pooling_request(
            request_id, prompt, ids, params, params.pooling, arrival, head, encoder_spans
        )
        return dataclasses.replace(pooled, multi_modal=multi_modal)
    scheduler_params = SchedulerParams.from_params(params, eos_token_ids)
    if params.beam_search is not None:
        group = BeamGroup(
            request_id,
            prompt,
            ids,
            params.beam_search,
            params.n,
            eos_token_ids,
            params.skip_special_tokens,
            arrival,
            tokenizer,
        )
        request = Request(
            request_id,
            ids,
            scheduler_params,
            arrival_time=arrival,
            cache_salt=lora_salt(params.cache_salt, lora),
            lora_id=None if lora is None else lora.lora_int_id,
            encoder_spans=encoder_spans,
        )
        return NewRequest(group, request, None, lora, multi_modal)
    state = RequestState(
        request_id,
        prompt,
        ids,
        params,
        scheduler_params.stop_token_ids,
        tokenizer,
        arrival,
        seed(params) if resume is None else resume.seed,
    )
    # Prompt logprobs need every prompt position computed: a private cache salt keeps the prefix cache from
    # skipping any (vLLM skips the cache for these requests too).
    salt = params.cache_salt if params.prompt_logprobs is None else f"prompt-logprobs:{request_id}"
    request = Request(
        request_id,
        ids,
        scheduler_params,
        arrival_time=arrival,
        cache_salt=lora_salt(salt, lora),
        lora_id=None if lora is None else lora.lora_int_id,
        encoder_spans=encoder_spans,
        slo=params.slo,
    )
    if resume is not None:  # its sequence goes on from its outputs, as after a preemption by recompute
        state.resume(resume)
        for token_id in resume.output_token_ids:
            request.append_output_token(token_id)
    constraint = params.structured_outputs
    if constraint is None and speculate is not None and params.speculative:
        return NewRequest(speculate(state), request, None, lora, multi_modal)
    grammar = None if constraint is None else (constraint, state.start_grammar)
    source = None if resume is None else resume.kv_source
    return NewRequest(state, request, grammar, lora, multi_modal, source)


def _pooling_request(
    request_id: str,
    prompt: str | None,
    ids: tuple[int, ...],
    params: SamplingParams,
    pooling: PoolingParams,
    arrival: float,
    head: ScoreHead | None,
    encoder_spans: Sequence[EncoderSpan],
) -> NewRequest:
    """A prefill-only request: the scheduler runs its prompt and one held row (max_tokens 1, nothing sampled)."""
    owner = PoolingRequest(request_id, prompt, ids, pooling, arrival, head)
    scheduler_params = SchedulerParams(
        max_tokens=1, min_tokens=0, n=1, stop_token_ids=(), priority=params.priority
    )
    # LAST reads only the last position, which admission always computes: a prefix-cache hit before it is exact.
    # MEAN and CLS read positions a hit would skip, and so may a cross-encoder's LAST when trailing pad tokens
    # put its row earlier: a private salt keeps the cache from skipping any.
    private = pooling.needs_every_position or owner.pooler.last_position != len(ids) - 1
    salt = f"pooling:{request_id}" if private else params.cache_salt
    request = Request(
        request_id, ids, scheduler_params, arrival_time=arrival, cache_salt=salt, encoder_spans=encoder_spans
    )
    return NewRequest(owner, request, None)
