"""The engine's cumulative token counts, for /metrics."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.scheduler import ScheduledRequest


@dataclass(slots=True)
class TokenCounters:
    """The engine's cumulative token counts, for /metrics."""

    # Prompt tokens computed: prefix-cache hits excluded, recomputed ones counted again.
    prompt_tokens: int = 0
    generation_tokens: int = 0  # tokens sampled

    def count_chunk(self, chunk: ScheduledRequest, num_prompt_tokens: int) -> None:
        """Count the prompt tokens a scheduled chunk computes."""
        self.prompt_tokens += max(0, min(chunk.seq_len, num_prompt_tokens) - chunk.start)
