"""Images for the media and API tests: encoded bytes, data URLs, a crafted oversized PNG header, and a local HTTP
server on 127.0.0.1 that counts the requests it gets."""

from __future__ import annotations

import base64
import contextlib
import io
import struct
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pagoda.server.multimodal import ImageItem, MultiModalInputs, ProcessedPrompt, content_key
from PIL import Image
from transformers import PreTrainedTokenizerBase


def image_bytes(
    fmt: str = "PNG", size: tuple[int, int] = (8, 6), color: tuple[int, int, int] = (200, 30, 10)
) -> bytes:
    """An encoded solid-colour image."""
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    """A base64 data URL of `data`."""
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` with a few bytes of image data: decoding it to full size would
    need width * height * 3 bytes, so a loader that refuses it from the header never gets that far."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        body = kind + payload
        return struct.pack(">I", len(payload)) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


@dataclass
class Route:
    """What the server answers on one path."""

    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0
    send_length: bool = True


@dataclass
class MediaServer:
    """A local HTTP server: its base URL, its routes, and every path it was asked for."""

    url: str
    routes: dict[str, Route]
    requested: list[str]


@contextmanager
def media_server() -> Iterator[MediaServer]:
    """An HTTP server on 127.0.0.1 (a free port) for the test's lifetime."""
    routes: dict[str, Route] = {}
    requested: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            requested.append(self.path)
            route = routes.get(self.path, Route(status=404))
            if route.delay_s:
                time.sleep(route.delay_s)
            self.send_response(route.status)
            for key, value in route.headers.items():
                self.send_header(key, value)
            if route.send_length:
                self.send_header("Content-Length", str(len(route.body)))
            self.end_headers()
            # The client may stop reading: what a byte cap does.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self.wfile.write(route.body)

        def log_message(self, format: str, *args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield MediaServer(f"http://127.0.0.1:{server.server_address[1]}", routes, requested)
    finally:
        server.shutdown()
        server.server_close()


MARKER = "(image)"
IMAGE_TOKENS = 5  # placeholder tokens the fake processor gives every image


@dataclass
class FakeProcessor:
    """A MultiModalProcessor: each marker becomes IMAGE_TOKENS `placeholder` ids; records every call."""

    tokenizer: PreTrainedTokenizerBase
    placeholder: int
    image_marker: str = MARKER
    calls: list[tuple[str, list[Image.Image]]] = field(default_factory=list)

    def process(
        self, prompt: str, images: Sequence[Image.Image], *, add_special_tokens: bool = True
    ) -> ProcessedPrompt:
        """Token ids with each image's span; ValueError when markers and images disagree in number."""
        self.calls.append((prompt, list(images)))
        pieces = prompt.split(self.image_marker)
        if len(pieces) - 1 != len(images):
            raise ValueError(f"{len(pieces) - 1} image markers but {len(images)} images")
        ids: list[int] = []
        items: list[ImageItem] = []
        for i, piece in enumerate(pieces):
            ids += self.tokenizer.encode(piece, add_special_tokens=False)
            if i < len(images):
                items.append(ImageItem(len(ids), IMAGE_TOKENS, content_key(images[i])))
                ids += [self.placeholder] * IMAGE_TOKENS
        return ProcessedPrompt(tuple(ids), MultiModalInputs(tuple(items)))
