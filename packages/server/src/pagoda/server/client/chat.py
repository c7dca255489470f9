"""`pagoda chat`: an interactive chat in the terminal against a running server, as `vllm chat`.

Each line typed is a user message; the reply streams in as the server sends it, and both join the history that
every later request carries (after the --system-prompt, if any). `/clear` empties the history, `/quit` (or
`/exit`, or Ctrl-D) leaves with status 0, Ctrl-C stops the reply being streamed (what came so far stays in the
history) or, at the prompt, clears the line. A server error is printed and the turn is dropped; the chat goes on.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from pagoda.server.client.http import ServerError, StreamingClient

HELP = "/clear clears the history, /quit or Ctrl-D exits, Ctrl-C stops a reply"
_QUIT = frozenset({"/quit", "/exit"})
# Reasoning text (--reasoning-parser servers) is shown dimmed in a terminal, apart from the answer.
_DIM, _RESET = "\x1b[2m", "\x1b[0m"


class ChatSession:
    """The history of one conversation and how to send its next turn."""

    def __init__(self, client: StreamingClient, args: argparse.Namespace, model: str, out: TextIO) -> None:
        self.client = client
        self.model = model
        self.out = out
        self.system_prompt: str | None = args.system_prompt
        self.options: dict[str, Any] = {
            name: getattr(args, name)
            for name in ("max_tokens", "temperature")
            if getattr(args, name) is not None
        }
        self.messages: list[dict[str, str]] = []
        self.clear()

    def clear(self) -> None:
        """Forget every turn (the system prompt stays)."""
        self.messages = (
            [] if self.system_prompt is None else [{"role": "system", "content": self.system_prompt}]
        )

    def send(self, text: str) -> None:
        """Send `text` as the next user message and stream the reply to `out`; ServerError drops the turn,
        KeyboardInterrupt keeps what was streamed as the reply (and propagates)."""
        self.messages.append({"role": "user", "content": text})
        body = {"model": self.model, "messages": self.messages, **self.options}
        reply: list[str] = []
        dim = self.out.isatty()
        try:
            for delta in self.client.stream_chat(body):
                if delta.reasoning:
                    self._write(f"{_DIM}{delta.reasoning}{_RESET}" if dim else delta.reasoning)
                if delta.text:
                    reply.append(delta.text)
                    self._write(delta.text)
        except ServerError:
            self.messages.pop()
            self._write("\n")
            raise
        except KeyboardInterrupt:
            self.messages.append({"role": "assistant", "content": "".join(reply)})
            self._write("\n")
            raise
        self.messages.append({"role": "assistant", "content": "".join(reply)})
        self._write("\n")

    def _write(self, text: str) -> None:
        """Write and flush: a streamed token shows as soon as it arrives."""
        self.out.write(text)
        self.out.flush()


def run_chat(args: argparse.Namespace, stdin: TextIO | None = None, out: TextIO | None = None) -> int:
    """Chat until /quit or end of input (0); 1 when the server cannot be reached or -q's reply fails."""
    stdin = sys.stdin if stdin is None else stdin
    out = sys.stdout if out is None else out
    client = StreamingClient(args.url, args.api_key)
    try:
        model = args.model or client.first_model()
        session = ChatSession(client, args, model, out)
        if args.quick is not None:
            session.send(args.quick)
            return 0
        return _loop(session, stdin, out)
    except ServerError as exc:
        print(f"pagoda chat: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()


def _loop(session: ChatSession, stdin: TextIO, out: TextIO) -> int:
    """Read lines and answer them until /quit or end of input."""
    interactive = stdin.isatty()
    if interactive:
        import readline  # noqa: F401 (imported for its side effect: line editing and history in input())

        out.write(f"pagoda chat: {session.model} at {session.client.root}; {HELP}\n")
    while True:
        try:
            line = _read_line(stdin, out, interactive)
        except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
            out.write("\n")
            continue
        if line is None or line.strip() in _QUIT:
            if line is None and interactive:
                out.write("\n")  # Ctrl-D leaves the cursor after the prompt
            return 0
        text = line.strip()
        if not text:
            continue
        if text == "/clear":
            session.clear()
            out.write("(history cleared)\n")
            continue
        if text == "/help":
            out.write(HELP + "\n")
            continue
        try:
            session.send(text)
        except ServerError as exc:
            print(f"error: {exc}", file=sys.stderr)
        except KeyboardInterrupt:
            out.write("(stopped)\n")


def _read_line(stdin: TextIO, out: TextIO, interactive: bool) -> str | None:
    """The next line (without its newline), or None at end of input; the '> ' prompt in a terminal."""
    if interactive and stdin is sys.stdin:
        try:
            return input("> ")  # readline's editing; EOFError on Ctrl-D
        except EOFError:
            return None
    if interactive:
        out.write("> ")
        out.flush()
    line = stdin.readline()
    return None if line == "" else line.rstrip("\n")
