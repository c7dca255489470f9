"""The OpenAI-compatible HTTP server: Starlette app, request models, async engine front, metrics."""

from pagoda.server.api.app import AppSettings, build_app
from pagoda.server.api.async_engine import AsyncLLM
from pagoda.server.api.engine_client import EngineClient

__all__ = ["AppSettings", "AsyncLLM", "EngineClient", "build_app"]
