"""`pagoda chat` in a real terminal (tmux) and `pagoda complete` over stdin, against a live tiny server; their
streaming against a server that holds its reply back; bad flags exit 2 naming them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from pagoda.server.cli import main
from pagoda.server.testing import LiveServer, free_port, make_tiny_model
from terminal import Terminal

MODEL = "tiny"
REPLY_TOKENS = 8
# Greedy and float32: the expected replies come from the same server's non-streamed answers.
GREEDY = ["--temperature", "0", "--max-tokens", str(REPLY_TOKENS)]
PAGODA = [sys.executable, "-m", "pagoda.server.cli"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One live tiny server for the module."""
    model = make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))
    flags = ["--dtype", "float32", "--kv-cache-gib", "0.05", "--max-model-len", "256"]
    with LiveServer(model, flags, served_model_name=MODEL) as live:
        yield live


def chat_reply(server: LiveServer, messages: list[dict[str, str]]) -> str:
    """The server's greedy reply to `messages`, not streamed."""
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": REPLY_TOKENS}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    response.raise_for_status()
    return str(response.json()["choices"][0]["message"]["content"])


def completion(server: LiveServer, prompt: str) -> str:
    """The server's greedy completion of `prompt`, not streamed."""
    body = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": REPLY_TOKENS}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return str(response.json()["choices"][0]["text"])


def client_env() -> dict[str, str]:
    """The environment a client subprocess needs: this interpreter's import path, a UTF-8 locale."""
    return {"PYTHONPATH": os.pathsep.join(sys.path), "LANG": "C.UTF-8", "PATH": os.environ.get("PATH", "")}


def reply_after(lines: list[str], prompt_line: str, occurrence: int = 1) -> str | None:
    """The line right after the `occurrence`-th `> prompt_line` once the next prompt shows; None until then."""
    seen = 0
    for index, line in enumerate(lines):
        if line == f"> {prompt_line}":
            seen += 1
            if seen == occurrence:
                rest = lines[index + 1 :]
                return rest[0] if len(rest) >= 2 and rest[1].startswith(">") else None
    return None


def test_chat_in_a_terminal_keeps_the_history_clears_it_and_exits_on_ctrl_d(server: LiveServer) -> None:
    """Typed lines get the server's replies; the second carries the first turn (its reply differs from the same
    line asked fresh); /clear forgets it (the same line then gets the fresh reply); Ctrl-D exits with status 0."""
    first, second = "Hello there", "Tell me about Paris"
    reply_1 = chat_reply(server, [{"role": "user", "content": first}])
    history = [
        {"role": "user", "content": first},
        {"role": "assistant", "content": reply_1},
        {"role": "user", "content": second},
    ]
    reply_2 = chat_reply(server, history)
    fresh_2 = chat_reply(server, [{"role": "user", "content": second}])
    # The tiny model's fixed weights give printable, distinct replies to these lines (else pick others).
    assert all(r.strip() and r.isprintable() for r in (reply_1, reply_2, fresh_2)), (
        reply_1,
        reply_2,
        fresh_2,
    )
    assert reply_2 != fresh_2, "these lines cannot tell whether the history was sent"
    command = [*PAGODA, "chat", "--url", server.base_url, *GREEDY]
    with Terminal(command, client_env()) as term:
        term.wait_for(
            lambda lines: any(line.startswith("pagoda chat: tiny at") for line in lines), "the banner"
        )
        term.wait_for(lambda lines: lines[-1] == ">", "the prompt")
        term.send_line(first)
        lines = term.wait_for(lambda lines: reply_after(lines, first) is not None, "the first reply")
        assert reply_after(lines, first) == reply_1.strip()
        term.send_line(second)
        lines = term.wait_for(lambda lines: reply_after(lines, second) is not None, "the second reply")
        assert reply_after(lines, second) == reply_2.strip()
        term.send_line("/clear")
        term.wait_for(lambda lines: "(history cleared)" in lines, "/clear's note")
        term.send_line(second)
        lines = term.wait_for(
            lambda lines: reply_after(lines, second, 2) is not None, "the reply after /clear"
        )
        assert reply_after(lines, second, 2) == fresh_2.strip()
        term.send_key("C-d")
        term.wait_for(lambda lines: "[exit status 0]" in lines, "exit status 0 after Ctrl-D")


class _HeldReplyServer(ThreadingHTTPServer):
    """A fake OpenAI server whose chat reply streams "Hel", then waits for `release` before "lo there!"."""

    release: threading.Event


class _HeldReplyHandler(BaseHTTPRequestHandler):
    """/v1/models lists "held"; POST /v1/chat/completions streams two deltas with a wait between them."""

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""

    def do_GET(self) -> None:
        """The model list."""
        body = json.dumps({"object": "list", "data": [{"id": "held", "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        """Two deltas, the second only once the test has seen the first on the screen (HTTP/1.0: the body ends
        when the connection closes)."""
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

        def event(text: str) -> None:
            chunk = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()

        event("Hel")
        assert isinstance(self.server, _HeldReplyServer)
        self.server.release.wait(60)
        event("lo there!")
        self.wfile.write(b"data: [DONE]\n\n")


def test_chat_streams_each_token_as_it_arrives() -> None:
    """The reply's first piece shows in the terminal while the server still holds the rest back."""
    fake = _HeldReplyServer(("127.0.0.1", 0), _HeldReplyHandler)
    fake.release = threading.Event()
    thread = threading.Thread(target=fake.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{fake.server_address[1]}/v1"
        with Terminal([*PAGODA, "chat", "--url", url], client_env()) as term:
            term.wait_for(lambda lines: bool(lines) and lines[-1] == ">", "the prompt")
            term.send_line("hi")
            lines = term.wait_for(lambda lines: "Hel" in lines, "the first piece alone")
            assert "Hello there!" not in lines
            fake.release.set()
            term.wait_for(lambda lines: "Hello there!" in lines, "the whole reply")
    finally:
        fake.release.set()
        fake.shutdown()
        fake.server_close()


def test_chat_quick_and_piped_lines(server: LiveServer) -> None:
    """-q prints one reply and exits 0; piped lines are turns (no prompt is drawn), /clear and /quit work."""
    reply = chat_reply(server, [{"role": "user", "content": "Hello there"}])
    quick = subprocess.run(
        [*PAGODA, "chat", "--url", server.base_url, *GREEDY, "-q", "Hello there"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert quick.returncode == 0, quick.stderr
    assert quick.stdout == reply + "\n"
    piped = subprocess.run(
        [*PAGODA, "chat", "--url", server.base_url, *GREEDY],
        input="Hello there\n/clear\nHello there\n/quit\nnever sent\n",
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == f"{reply}\n(history cleared)\n{reply}\n"


def test_complete_reads_prompts_from_stdin_lines(server: LiveServer) -> None:
    """Each stdin line is a prompt; the completions come out in order, one per line, as the server gives them."""
    prompts = ["The capital of France is", "Tokens, blocks and tables"]
    expected = "".join(completion(server, prompt) + "\n" for prompt in prompts)
    done = subprocess.run(
        [*PAGODA, "complete", "--url", f"{server.base_url}/v1", *GREEDY],
        input="".join(p + "\n" for p in prompts),
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected
    quick = subprocess.run(
        [*PAGODA, "complete", "--url", server.base_url, *GREEDY, "-q", prompts[0]],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert quick.stdout == completion(server, prompts[0]) + "\n"


def test_clients_report_server_errors_and_unreachable_servers(server: LiveServer) -> None:
    """A model the server does not serve: its 404 message, exit 1 for -q, and a piped chat goes on (exit 0)
    after each failed turn; no server at the URL: exit 1 saying it cannot be reached."""
    wrong = subprocess.run(
        [*PAGODA, "chat", "--url", server.base_url, "--model", "no-such-model", "-q", "hi"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert wrong.returncode == 1 and "404" in wrong.stderr and "no-such-model" in wrong.stderr
    piped = subprocess.run(
        [*PAGODA, "chat", "--url", server.base_url, "--model", "no-such-model"],
        input="hi\nhi again\n", capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert piped.returncode == 0 and piped.stderr.count("error: 404") == 2, piped.stderr
    nobody = f"http://127.0.0.1:{free_port()}"
    for command in ("chat", "complete"):
        gone = subprocess.run(
            [*PAGODA, command, "--url", nobody, "-q", "hi"],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert gone.returncode == 1 and "cannot reach" in gone.stderr, gone.stderr


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["chat", "--temperature", "3"], "--temperature"),
        (["chat", "--max-tokens", "0"], "--max-tokens"),
        (["chat", "--no-such-flag"], "--no-such-flag"),
        (["complete", "--max-tokens", "many"], "--max-tokens"),
        (["complete", "--system-prompt", "x"], "--system-prompt"),  # a chat flag
    ],
)
def test_bad_client_flags_exit_2_naming_the_flag(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse's exit 2, its message naming the flag, before any connection."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert named in capsys.readouterr().err


def test_the_clients_import_no_engine(tmp_path: Path) -> None:
    """`pagoda chat` and `complete` are HTTP clients: importing them loads neither torch nor transformers."""
    code = (
        "import sys, pagoda.server.client.chat, pagoda.server.client.complete\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]"
