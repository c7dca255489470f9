"""The pooling runner (`--runner pooling`): prompts pooled into embedding vectors, or scored by a cross-encoder's
head (`classifier`; `scoring` pairs texts up for /score and /rerank), over the same engine.

`params` (the pooler config and per-request params) is light and imported by `SamplingParams`; `request`
(`PoolingRequest`, an `EngineRequest`) and `pooler` are imported where the engine makes requests.
"""

from pagoda.server.pooling.params import (
    PoolerConfig,
    PoolerConfigError,
    PoolingParams,
    PoolingTask,
    PoolingType,
    RunnerName,
    SupportedTask,
    parse_pooler_config,
)

__all__ = [
    "PoolerConfig",
    "PoolerConfigError",
    "PoolingParams",
    "PoolingTask",
    "PoolingType",
    "RunnerName",
    "SupportedTask",
    "parse_pooler_config",
]
