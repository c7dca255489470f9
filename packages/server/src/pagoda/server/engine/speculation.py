"""The engine's side of speculative decoding: whether its requests draft, and what wraps them."""

from __future__ import annotations

import logging
from collections.abc import Callable

from pagoda.scheduler import Scheduler
from pagoda.server.config import EngineConfig
from pagoda.server.engine.engine_request import EngineRequest
from pagoda.server.engine.requests import RequestState
from pagoda.server.spec.build import build_speculation

logger = logging.getLogger(__name__)


def speculation_for(
    config: EngineConfig, scheduler: Scheduler
) -> Callable[[RequestState], EngineRequest] | None:
    """What makes a plain request speculative, or None (no `speculative_config`, or an allocator without
    `trim`: the contiguous KV manager)."""
    spec = config.speculative_config
    if spec is None:
        return None
    if not scheduler.supports_drafts:
        logger.warning(
            "speculative decoding is off: the %s KV manager cannot trim", config.cache_config.kv_manager
        )
        return None
    return build_speculation(spec)
