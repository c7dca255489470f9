"""Read-only views of the scheduler's queues for live displays (the dashboard), copied on the engine thread."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pagoda.scheduler.request import Request


@dataclass(frozen=True, slots=True)
class QueueEntry:
    """One sequence in a queue: its progress, its chunk in the last step and its priority."""

    request_id: str
    num_computed_tokens: int  # tokens whose KV is computed
    num_tokens: int  # prompt + outputs so far
    num_prompt_tokens: int
    chunk: int  # tokens the last step computed for it (0: not scheduled in that step)
    priority: int


@dataclass(frozen=True, slots=True)
class QueueView:
    """The running, waiting and swapped queues, each in the scheduler's order."""

    running: tuple[QueueEntry, ...]
    waiting: tuple[QueueEntry, ...]
    swapped: tuple[QueueEntry, ...]


def _entries(requests: Iterable[Request], chunks: Mapping[str, int]) -> tuple[QueueEntry, ...]:
    """One entry per request, in order."""
    return tuple(
        QueueEntry(
            r.request_id,
            r.num_computed_tokens,
            r.num_tokens,
            r.num_prompt_tokens,
            chunks.get(r.request_id, 0),
            r.priority,
        )
        for r in requests
    )


def queue_view(
    running: Iterable[Request],
    waiting: Iterable[Request],
    swapped: Iterable[Request],
    chunks: Mapping[str, int],
) -> QueueView:
    """The three queues as entries; `chunks` maps a sequence id to its chunk length in the last step."""
    return QueueView(_entries(running, chunks), _entries(waiting, chunks), _entries(swapped, chunks))
