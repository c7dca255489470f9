"""The engine: scheduler + paged KV cache + model runner + sampler, stepped by `LLMEngine.step`."""

from pagoda.server.config import EngineConfig
from pagoda.server.engine.llm_engine import LLMEngine, RequestRejectedError
from pagoda.server.engine.setup import EngineConfigError

__all__ = ["EngineConfig", "EngineConfigError", "LLMEngine", "RequestRejectedError"]
