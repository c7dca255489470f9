"""The flags of `pagoda chat` and `pagoda complete` (vLLM's: --url, --model-name, --api-key, --system-prompt,
-q/--quick; plus --model, --max-tokens and --temperature). Imports nothing heavy: `pagoda --help` stays fast."""

from __future__ import annotations

import argparse
from typing import Any

DEFAULT_URL = "http://localhost:8000/v1"  # vLLM's default; the server root works too


def _common(parser: argparse.ArgumentParser) -> None:
    """The flags both clients take."""
    parser.add_argument(
        "--url", default=DEFAULT_URL, help="the server, or its /v1 root (default: %(default)s)"
    )
    parser.add_argument(
        "--model",
        "--model-name",
        dest="model",
        default=None,
        help="the model to ask (default: the first model the server's /v1/models lists)",
    )
    parser.add_argument("--api-key", default=None, help="the server's --api-key (default: $OPENAI_API_KEY)")
    parser.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=None,
        help="tokens per reply at most (default: the server's)",
    )
    parser.add_argument(
        "--temperature",
        type=_temperature,
        default=None,
        help="sampling temperature, 0 for greedy (default: the server's, 1.0)",
    )


def _positive_int(text: str) -> int:
    """An integer >= 1 (argparse names the flag when it is not one)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _temperature(text: str) -> float:
    """A temperature in [0, 2], as the API takes."""
    value = float(text)
    if not 0.0 <= value <= 2.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 2], got {value}")
    return value


def add_client_commands(commands: Any) -> None:  # argparse's private _SubParsersAction
    """Add `chat` and `complete` to the `pagoda` command's subparsers."""
    chat = commands.add_parser(
        "chat",
        help="chat with a running server in the terminal (as `vllm chat`)",
        description="An interactive chat against a running OpenAI-compatible server: the reply streams in, the "
        "history is kept; /clear clears it, /quit or Ctrl-D exits, Ctrl-C stops a reply.",
    )
    _common(chat)
    chat.add_argument("--system-prompt", default=None, help="a system message opening the conversation")
    chat.add_argument(
        "-q", "--quick", metavar="MESSAGE", default=None, help="send one message, print the reply, exit"
    )
    chat.set_defaults(run=_run_chat)
    complete = commands.add_parser(
        "complete",
        help="complete prompts against a running server (as `vllm complete`)",
        description="Prompts in, completions streamed out: typed at a '> ' prompt in a terminal, else one prompt "
        "per line of stdin (each completion then ends with a newline).",
    )
    _common(complete)
    complete.add_argument(
        "-q", "--quick", metavar="PROMPT", default=None, help="complete one prompt, print it, exit"
    )
    complete.set_defaults(run=_run_complete)


def _run_chat(args: argparse.Namespace) -> int:
    """`pagoda chat` (imported when run: the client needs httpx)."""
    from pagoda.server.client.chat import run_chat

    return run_chat(args)


def _run_complete(args: argparse.Namespace) -> int:
    """`pagoda complete`."""
    from pagoda.server.client.complete import run_complete

    return run_complete(args)
