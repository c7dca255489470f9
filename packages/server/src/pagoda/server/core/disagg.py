"""Prefill/decode disaggregation, the front end's half: which engine cores prefill, which decode, and the hand-off
of a request from one to the other (`--prefill-replicas N --decode-replicas M`).

A request that can move (one plain sample: `can_resume`) with max_tokens > 1 goes to a prefill core as a request
of max_tokens 1, seeded (an unseeded one gets a seed here, numbered from `--seed` as an engine numbers its own).
The prefill core computes the prompt, saves its full KV blocks to the host tier that the cores of this host share
(write-through, before the step's outputs leave the core) and draws the first token. The front end streams that
token and sends the request on to the least loaded decode core with `Resume`: the decode core finds the prompt's
blocks through its prefix cache (tier hits), computes the last partial block and the first token, and draws on,
its sampler keyed by (seed, sample index, output position), so the tokens are those one core would draw. Requests
that cannot move (n > 1, beam search, pooling, prompt logprobs) run wholly on a prefill core.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Literal

from pagoda.server.handoff import Resume, can_resume
from pagoda.server.multimodal.wire import WireMultiModal
from pagoda.server.outputs import RequestOutput
from pagoda.server.sampling.detokenizer import stop_holdback
from pagoda.server.sampling.records import unseeded_seed
from pagoda.server.sampling_params import SamplingParams

Role = Literal["prefill", "decode"]


def roles_of(prefill_replicas: int, decode_replicas: int) -> tuple[Role, ...]:
    """Each engine core's role in index order: the prefill cores first, then the decode cores."""
    prefill: tuple[Role, ...] = ("prefill",)
    decode: tuple[Role, ...] = ("decode",)
    return prefill * prefill_replicas + decode * decode_replicas


@dataclass(slots=True)
class _Request:
    """A request that moves: what its decode leg is sent, and its first leg's output once handed off."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # as asked, with its seed
    multi_modal: WireMultiModal | None
    first: RequestOutput | None = None  # the prefill core's output (its first token), once handed off
    handed_at: float | None = None  # when the decode leg was sent (monotonic)


@dataclass(frozen=True, slots=True)
class HandOff:
    """A decode leg to send: the request's prompt, parameters and outputs so far."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    multi_modal: WireMultiModal | None
    resume: Resume


@dataclass(slots=True)
class TransferCounters:
    """The hand-offs so far: how many, the KV bytes the decode cores took from the tier, and the seconds from the
    first token to the decode core's next (the transfer, the queue and the last partial block's compute)."""

    transfers: int = 0
    bytes: int = 0
    seconds: float = 0.0


class Disaggregation:
    """The roles of the engine cores and every request between its prefill leg and its end."""

    def __init__(self, roles: tuple[Role, ...], engine_seed: int) -> None:
        self.roles = roles
        self._engine_seed = engine_seed
        self._unseeded = 0
        self._requests: dict[str, _Request] = {}
        self.counters = TransferCounters()

    def serves(self, index: int, role: Role) -> bool:
        """Whether core `index` has `role`."""
        return self.roles[index] == role

    def first_leg(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        multi_modal: WireMultiModal | None,
    ) -> SamplingParams:
        """The parameters a prefill core runs: max_tokens 1 and a seed for a request that moves on (remembered
        until it ends), the request's own for one that stays."""
        if not can_resume(params) or params.max_tokens <= 1:
            return params
        seed = params.seed
        if seed is None:
            self._unseeded += 1
            seed = unseeded_seed(self._engine_seed, self._unseeded)
        seeded = dataclasses.replace(params, seed=seed)
        self._requests[request_id] = _Request(prompt, prompt_token_ids, seeded, multi_modal)
        return dataclasses.replace(seeded, max_tokens=1, min_tokens=min(params.min_tokens, 1))

    def after_prefill(
        self, output: RequestOutput, max_model_len: int, kv_source: str | None = None
    ) -> HandOff | None:
        """The decode leg of a request whose prefill leg just finished at its length cap (`kv_source`: the prefill
        core's KV block server, when the decode cores pull over TCP); None when it ends here (a stop, an abort, a
        request that does not move, or one whose sequence is full)."""
        request = self._requests.get(output.request_id)
        if request is None or request.first is not None:
            return None
        (sample,) = output.outputs
        if sample.finish_reason != "length" or len(request.prompt_token_ids) + 1 >= max_model_len:
            del self._requests[output.request_id]
            return None
        request.first, request.handed_at = output, time.monotonic()
        resume = Resume(
            list(sample.token_ids),
            request.params.seed or 0,
            None if sample.logprobs is None else list(sample.logprobs),
            sample.cumulative_logprob,
            kv_source,
        )
        return HandOff(request.prompt, request.prompt_token_ids, request.params, request.multi_modal, resume)

    def streamed_first(self, output: RequestOutput) -> RequestOutput:
        """The prefill leg's last output as the client sees it: unfinished, its text holding back what a stop
        string may still use (as an unfinished sample's does)."""
        request = self._requests[output.request_id]
        (sample,) = output.outputs
        holdback = stop_holdback(request.params)
        text = sample.text[: max(0, len(sample.text) - holdback)] if holdback else sample.text
        unfinished = dataclasses.replace(sample, text=text, finish_reason=None, stop_reason=None)
        return dataclasses.replace(output, outputs=(unfinished,), finished=False)

    def decode_output(self, output: RequestOutput, block_size: int, kv_block_bytes: int) -> RequestOutput:
        """A decode leg's output as the client sees it: the request's arrival, first token and cached tokens are
        the prefill leg's. Its first output counts the transfer."""
        request = self._requests.get(output.request_id)
        if request is None or request.first is None:
            return output
        if request.handed_at is not None:  # the decode core's first output: the blocks it found came over
            counters = self.counters
            counters.transfers += 1
            counters.bytes += output.num_cached_tokens // block_size * kv_block_bytes
            counters.seconds += time.monotonic() - request.handed_at
            request.handed_at = None
        first = request.first.metrics
        metrics = dataclasses.replace(
            output.metrics,
            arrival_time=first.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=first.first_token_time,
        )
        if output.finished:
            del self._requests[output.request_id]
        return dataclasses.replace(output, metrics=metrics, num_cached_tokens=request.first.num_cached_tokens)

    def forget(self, request_id: str) -> None:
        """A request failed or was refused: nothing more of it is expected."""
        self._requests.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """The client aborted: a prefill leg that finished meanwhile ends there (a decode leg is aborted by its
        core, whose last output still carries the prefill leg's timings)."""
        if not self.is_handed_off(request_id):
            self._requests.pop(request_id, None)

    def is_handed_off(self, request_id: str) -> bool:
        """Whether the request's decode leg was sent."""
        request = self._requests.get(request_id)
        return request is not None and request.first is not None
