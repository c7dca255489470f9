"""Speculative decoding: proposers draft tokens, one forward pass verifies them all (issue #25).

`config`: `SpeculativeConfig` (vLLM's `--speculative-config` keys); `proposer`: the `Proposer` interface;
`ngram`: prompt lookup; `verify`: the rows of a drafted chunk and the accepted run; `request`: the
`SpeculativeRequest` that drafts for a plain request; `build`: what the engine wraps requests in.
Only `config` is imported here (the engine's config imports it); no module imports the engine at run time.
"""

from __future__ import annotations

from pagoda.server.spec.config import SpeculativeConfig, SpeculativeMethod, parse_speculative_config

__all__ = ["SpeculativeConfig", "SpeculativeMethod", "parse_speculative_config"]
