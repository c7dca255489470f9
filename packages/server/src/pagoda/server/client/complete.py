"""`pagoda complete`: prompts in, completions streamed out, as `vllm complete`.

In a terminal each line typed at the '> ' prompt is completed (Ctrl-D or /quit exits, Ctrl-C stops a completion);
with stdin not a terminal, every line of it is a prompt and its completion is written to stdout followed by a
newline, so `printf 'a\\nb\\n' | pagoda complete` prints two completions, one after the other. -q completes one.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from pagoda.server.client.http import ServerError, StreamingClient


def run_complete(args: argparse.Namespace, stdin: TextIO | None = None, out: TextIO | None = None) -> int:
    """Complete every prompt; 0, or 1 when the server cannot be reached or a completion failed."""
    stdin = sys.stdin if stdin is None else stdin
    out = sys.stdout if out is None else out
    client = StreamingClient(args.url, args.api_key)
    try:
        model = args.model or client.first_model()
        options: dict[str, Any] = {
            name: getattr(args, name)
            for name in ("max_tokens", "temperature")
            if getattr(args, name) is not None
        }
        if args.quick is not None:
            _complete(client, {"model": model, "prompt": args.quick, **options}, out)
            return 0
        status = 0
        interactive = stdin.isatty()
        if interactive:
            import readline  # noqa: F401 (line editing and history in input())
        while True:
            prompt = _next_prompt(stdin, interactive)
            if prompt is None:
                return status
            if interactive and not prompt.strip():
                continue
            try:
                _complete(client, {"model": model, "prompt": prompt, **options}, out)
            except ServerError as exc:
                print(f"error: {exc}", file=sys.stderr)
                status = 1
            except KeyboardInterrupt:
                out.write("\n")
                if not interactive:
                    return 130
    except ServerError as exc:
        print(f"pagoda complete: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()


def _next_prompt(stdin: TextIO, interactive: bool) -> str | None:
    """The next prompt, or None at end of input (or /quit in a terminal)."""
    if interactive:
        while True:
            try:
                line = input("> ") if stdin is sys.stdin else stdin.readline().rstrip("\n")
            except EOFError:
                print()
                return None
            except KeyboardInterrupt:
                print()
                continue
            return None if line.strip() in ("/quit", "/exit") else line
    line = stdin.readline()
    return None if line == "" else line.rstrip("\n")


def _complete(client: StreamingClient, body: dict[str, Any], out: TextIO) -> None:
    """Stream one completion to `out`, then a newline."""
    try:
        for text in client.stream_completion(body):
            out.write(text)
            out.flush()
    finally:
        out.write("\n")
        out.flush()
