"""The engine: scheduler + paged KV cache + model runner + sampler, stepped by `LLMEngine.step`."""

from pagoda.server.config import EngineConfig
from pagoda.server.engine.admission import AdmissionRules, RequestRejectedError
from pagoda.server.engine.llm_engine import LLMEngine
from pagoda.server.engine.setup import EngineConfigError
from pagoda.server.request_contract import EngineRequest

__all__ = [
    "AdmissionRules",
    "EngineConfig",
    "EngineConfigError",
    "EngineRequest",
    "LLMEngine",
    "RequestRejectedError",
]
