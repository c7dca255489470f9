"""The OpenAI-compatible HTTP server: Starlette app, request models, handlers; `pagoda.server.async_llm` feeds it."""

from pagoda.server.api.app import build_app
from pagoda.server.config import AppSettings

__all__ = ["AppSettings", "build_app"]
