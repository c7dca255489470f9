"""The command-line clients of a running server, as vLLM's: `pagoda chat` (`chat`) and `pagoda complete`
(`complete`), over a small streaming OpenAI client (`http`). They talk HTTP only: no engine, no torch."""
