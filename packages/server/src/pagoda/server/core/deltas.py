"""Cumulative snapshots <-> deltas: the core sends what changed, the front end rebuilds the snapshot.

`DeltaEncoder` (core side) remembers the last snapshot it sent of each unfinished request; `DeltaDecoder` (front
end side) remembers the snapshot it rebuilt. Both forget a request once its finished snapshot passed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from pagoda.server.core.messages import OutputDelta, PositionLogprobs, SampleDelta
from pagoda.server.outputs import CompletionOutput, RequestOutput

T = TypeVar("T")


def _common_prefix(old: Sequence[T], new: Sequence[T]) -> int:
    """How many leading items `new` shares with `old` (all of `old` in the usual append-only case)."""
    n = len(old)
    if len(new) >= n and new[:n] == old:
        return n
    keep = 0
    for a, b in zip(old, new, strict=False):
        if a != b:
            break
        keep += 1
    return keep


def _sample_delta(old: CompletionOutput | None, new: CompletionOutput) -> SampleDelta:
    old_ids = () if old is None else old.token_ids
    old_text = "" if old is None else old.text
    old_logprobs = () if old is None or old.logprobs is None else old.logprobs
    ids_keep = _common_prefix(old_ids, new.token_ids)
    text_keep = len(old_text) if new.text.startswith(old_text) else _common_prefix(old_text, new.text)
    logprobs = None
    logprobs_keep = 0
    if new.logprobs is not None:
        logprobs_keep = _common_prefix(old_logprobs, new.logprobs)
        logprobs = list(new.logprobs[logprobs_keep:])
    return SampleDelta(
        index=new.index,
        token_ids_keep=ids_keep,
        token_ids=list(new.token_ids[ids_keep:]),
        text_keep=text_keep,
        text=new.text[text_keep:],
        logprobs_keep=logprobs_keep,
        logprobs=logprobs,
        cumulative_logprob=new.cumulative_logprob,
        finish_reason=new.finish_reason,
        stop_reason=new.stop_reason,
    )


class DeltaEncoder:
    """Core side: each snapshot as the change since the last one sent of the same request."""

    def __init__(self) -> None:
        self._sent: dict[str, RequestOutput] = {}

    def encode(self, output: RequestOutput) -> OutputDelta:
        """The delta of `output` against the request's previous snapshot (forgotten once finished)."""
        old = self._sent.pop(output.request_id, None)
        if not output.finished:
            self._sent[output.request_id] = output
        old_samples = {} if old is None else {s.index: s for s in old.outputs}
        prompt_logprobs = None
        keep = 0
        if output.prompt_logprobs is not None:
            previous = () if old is None or old.prompt_logprobs is None else old.prompt_logprobs
            keep = _common_prefix(previous, output.prompt_logprobs)
            prompt_logprobs = list(output.prompt_logprobs[keep:])
        return OutputDelta(
            request_id=output.request_id,
            samples=[_sample_delta(old_samples.get(s.index), s) for s in output.outputs],
            finished=output.finished,
            metrics=output.metrics,
            num_cached_tokens=output.num_cached_tokens,
            prompt_logprobs_keep=keep,
            prompt_logprobs=prompt_logprobs,
            embedding=None if output.embedding is None else list(output.embedding),
        )

    def forget(self, request_id: str) -> None:
        """Drop a request's memory (it left without a finished snapshot)."""
        self._sent.pop(request_id, None)


def _apply_sample(old: CompletionOutput | None, delta: SampleDelta) -> CompletionOutput:
    old_ids = () if old is None else old.token_ids
    old_text = "" if old is None else old.text
    logprobs: tuple[PositionLogprobs, ...] | None = None
    if delta.logprobs is not None:
        old_logprobs = () if old is None or old.logprobs is None else old.logprobs
        logprobs = old_logprobs[: delta.logprobs_keep] + tuple(delta.logprobs)
    return CompletionOutput(
        index=delta.index,
        text=old_text[: delta.text_keep] + delta.text,
        token_ids=old_ids[: delta.token_ids_keep] + tuple(delta.token_ids),
        cumulative_logprob=delta.cumulative_logprob,
        logprobs=logprobs,
        finish_reason=delta.finish_reason,
        stop_reason=delta.stop_reason,
    )


class DeltaDecoder:
    """Front-end side: rebuild each request's cumulative snapshot from its deltas and the prompt it sent."""

    def __init__(self) -> None:
        self._prompts: dict[str, tuple[str | None, tuple[int, ...]]] = {}
        self._last: dict[str, RequestOutput] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: Sequence[int]) -> None:
        """Remember a request's prompt (the core never sends it back)."""
        self._prompts[request_id] = (prompt, tuple(prompt_token_ids))

    def decode(self, delta: OutputDelta) -> RequestOutput | None:
        """The request's snapshot after `delta`; None for a request this decoder does not know."""
        prompt = self._prompts.get(delta.request_id)
        if prompt is None:
            return None
        old = self._last.get(delta.request_id)
        old_samples = {} if old is None else {s.index: s for s in old.outputs}
        prompt_logprobs = None
        if delta.prompt_logprobs is not None:
            previous = () if old is None or old.prompt_logprobs is None else old.prompt_logprobs
            prompt_logprobs = previous[: delta.prompt_logprobs_keep] + tuple(delta.prompt_logprobs)
        output = RequestOutput(
            request_id=delta.request_id,
            prompt=prompt[0],
            prompt_token_ids=prompt[1],
            outputs=tuple(_apply_sample(old_samples.get(s.index), s) for s in delta.samples),
            finished=delta.finished,
            metrics=delta.metrics,
            num_cached_tokens=delta.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            embedding=None if delta.embedding is None else tuple(delta.embedding),
        )
        if delta.finished:
            self.forget(delta.request_id)
        else:
            self._last[delta.request_id] = output
        return output

    def forget(self, request_id: str) -> None:
        """Drop a request (finished, failed, or its replica died)."""
        self._prompts.pop(request_id, None)
        self._last.pop(request_id, None)
