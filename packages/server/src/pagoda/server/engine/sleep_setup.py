"""Sleep mode's parts of one engine: each runner's KV pool and weights, with how to read its weights back."""

from __future__ import annotations

from pathlib import Path

from pagoda.server.config import EngineConfig
from pagoda.server.engine.draft_setup import LoadedDraft
from pagoda.server.engine.executor.base import Executor
from pagoda.server.engine.model_runner import ModelRunner
from pagoda.server.engine.setup import EngineParts, Placement, pack_rows, reload_model
from pagoda.server.engine.sleep import EngineSleep, ModelWeights, SleepingRunner
from pagoda.server.loader import resolve_model_folder
from torch import nn


def engine_sleep(
    config: EngineConfig, parts: EngineParts, executor: Executor, draft: LoadedDraft | None
) -> EngineSleep:
    """The sleep state of an engine's target runner and, with a draft model, of the draft's runner: each one's
    weights read back at wake from the folder it was loaded from. Under tensor parallelism the driver's runner
    holds rank 0's shard (read back as a shard) and the executor's workers sleep and wake with it."""
    placement = Placement(parts.device, parts.dtype)
    rows = pack_rows(config)
    runner = executor.driver
    group = executor.shard_group()

    def reload_target() -> nn.Module:
        return reload_model(config, parts.model_path, placement, group=group)

    runners = [SleepingRunner(runner.kv_cache, ModelWeights(runner.model, reload_target, rows))]
    spec = config.speculative_config
    if draft is not None and spec is not None and spec.model is not None:
        cache_dir = config.model_config.cache_dir
        draft_folder = resolve_model_folder(spec.model, None if cache_dir is None else Path(cache_dir))

        def reload_draft() -> nn.Module:
            return reload_model(config, draft_folder, placement, quantize=False)

        draft_runner = draft.drafter.runner
        assert isinstance(draft_runner, ModelRunner)  # the draft's runner is a ModelRunner (draft_setup.py)
        runners.append(
            SleepingRunner(draft_runner.kv_cache, ModelWeights(draft_runner.model, reload_draft, rows))
        )
    return EngineSleep(runners, parts.device, executor)
