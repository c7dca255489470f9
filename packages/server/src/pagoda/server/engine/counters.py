"""The engine's cumulative token counts, for /metrics."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pagoda.scheduler import ScheduledRequest


@dataclass(slots=True)
class TokenCounters:
    """The engine's cumulative token counts, for /metrics."""

    # Prompt tokens computed: prefix-cache hits excluded, recomputed ones counted again.
    prompt_tokens: int = 0
    generation_tokens: int = 0  # tokens sampled
    # Speculative decoding (vLLM's metric names): drafted chunks, their draft tokens, the accepted ones, and
    # accepted drafts by position (index j: drafts accepted at position j of a run).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def count_drafts(self, verified: Iterable[tuple[int, int]]) -> None:
        """Count each verified chunk's (drafts, accepted drafts)."""
        per_pos = self.spec_decode_num_accepted_tokens_per_pos
        for k, accepted in verified:
            self.spec_decode_num_drafts += 1
            self.spec_decode_num_draft_tokens += k
            self.spec_decode_num_accepted_tokens += accepted
            if len(per_pos) < k:
                per_pos.extend([0] * (k - len(per_pos)))
            for j in range(accepted):
                per_pos[j] += 1

    def count_chunk(self, chunk: ScheduledRequest, num_prompt_tokens: int) -> None:
        """Count the prompt tokens a scheduled chunk computes."""
        self.prompt_tokens += max(0, min(chunk.seq_len, num_prompt_tokens) - chunk.start)
