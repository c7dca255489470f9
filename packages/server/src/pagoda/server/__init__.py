"""Pagoda engine and OpenAI-compatible server."""
