"""The engine's unfinished requests: by request id, by scheduler sequence id, and by capability.

A request's capabilities (`pagoda.server.request_contract`) are resolved once, when it is registered, into maps
keyed by sequence id: the step sampler and the engine look a row's owner up in the map of the capability they
need instead of asking every request every step.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.server.request_contract import (
    EngineRequest,
    SamplesTokens,
    ScoresPrompt,
    TakesHiddenStates,
    TakesLogprobRows,
)


class RequestOwners:
    """Unfinished requests, their sequences, and the sequences of each row capability."""

    def __init__(self) -> None:
        self.requests: dict[str, EngineRequest] = {}  # by user request id
        self.seqs: dict[str, EngineRequest] = {}  # scheduler sequence id -> its request
        self.samplers: dict[str, SamplesTokens] = {}  # sequences whose rows the sampler draws
        self.row_takers: dict[str, TakesLogprobRows] = {}  # sequences whose rows are handed over
        self.prompt_scorers: dict[str, ScoresPrompt] = {}  # sequences of requests with prompt logprobs
        self.hidden_takers: dict[str, TakesHiddenStates] = {}  # sequences of requests taking hidden states
        self.num_prompt_tokens: dict[str, int] = {}  # by user request id (the prompt tokens a chunk computes)

    def own(self, owner: EngineRequest, num_prompt_tokens: int) -> None:
        """Register a new request (TypeError if it has no way to take its rows)."""
        self.num_prompt_tokens[owner.request_id] = num_prompt_tokens
        self._own_seqs(owner)

    def reseat(self, owner: EngineRequest, old_seq_ids: Sequence[str]) -> None:
        """Move a request from its old sequences to its current ones (a beam group forked or pruned beams)."""
        self._forget_seqs(old_seq_ids)
        self._own_seqs(owner)

    def forget(self, owner: EngineRequest, seq_ids: Sequence[str]) -> None:
        """Drop a request and these sequences of it."""
        self.requests.pop(owner.request_id, None)
        self.num_prompt_tokens.pop(owner.request_id, None)
        self._forget_seqs(seq_ids)

    def _own_seqs(self, owner: EngineRequest) -> None:
        """Register `owner` under its current sequences, in the map of each capability it has."""
        seq_ids = owner.seq_ids
        if isinstance(owner, SamplesTokens):
            self.samplers.update(dict.fromkeys(seq_ids, owner))
        elif isinstance(owner, TakesLogprobRows):
            self.row_takers.update(dict.fromkeys(seq_ids, owner))
        else:
            raise TypeError(f"request {owner.request_id!r} neither samples tokens nor takes logprob rows")
        if isinstance(owner, ScoresPrompt):
            self.prompt_scorers.update(dict.fromkeys(seq_ids, owner))
        if isinstance(owner, TakesHiddenStates):
            self.hidden_takers.update(dict.fromkeys(seq_ids, owner))
        self.requests[owner.request_id] = owner
        self.seqs.update(dict.fromkeys(seq_ids, owner))

    def _forget_seqs(self, seq_ids: Sequence[str]) -> None:
        """Drop these sequences from every map."""
        for seq_id in seq_ids:
            self.seqs.pop(seq_id, None)
            self.samplers.pop(seq_id, None)
            self.row_takers.pop(seq_id, None)
            self.prompt_scorers.pop(seq_id, None)
            self.hidden_takers.pop(seq_id, None)
