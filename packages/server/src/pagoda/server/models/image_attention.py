"""Placeholder: replaced by the vlm-llava branch's implementation."""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.server.models.attention import AttentionMetadata


def bidirectional_metadata(
    attn: AttentionMetadata, spans: Sequence[tuple[int, int, int]]
) -> AttentionMetadata:
    """Attention metadata in which each span's queries see the whole span (see the vlm-llava branch)."""
    raise NotImplementedError("bidirectional image attention lands with the Gemma 3 model")
