"""Where a prompt's images come from, and what is refused before any byte is decoded or any connection is made.

An image URL is a `data:` URL (strict base64), an `http(s)://` URL on a host of `--allowed-media-domains`
(fetched with a timeout and a byte cap, redirects only to allowed hosts), or a `file://` URL under
`--allowed-local-media-path`; anything else is a `MediaError` naming the request field. Only PNG, JPEG and WebP
are decoded, and an image over the pixel cap is refused from its header, before it is decoded to full size.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx
from pagoda.server.config import (
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES_PER_PROMPT,
    DEFAULT_MEDIA_FETCH_TIMEOUT,
    PIL_MAX_IMAGE_PIXELS,
    MultiModalConfig,
)
from PIL import Image, UnidentifiedImageError

MAX_REDIRECTS = 3

# Leading bytes of each format, to name what was sent; only the first three are decoded.
_SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"\xff\xd8\xff", "JPEG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
)
ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP")


class MediaError(ValueError):
    """An image refused (not allowed, unreadable, too large); `param` names the request field, as
    RequestRejectedError's does, so that the API answers a 400 naming it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """Where images may come from and how large they may be."""

    allowed_media_domains: tuple[str, ...] = ()  # exact host names http(s) images may be fetched from
    allowed_local_media_path: Path | None = None  # file:// images only under this folder (None: none)
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # encoded size of one image
    fetch_timeout_s: float = DEFAULT_MEDIA_FETCH_TIMEOUT  # a whole http(s) fetch, redirects included
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # width x height, checked from the header
    max_images_per_prompt: int = DEFAULT_MAX_IMAGES_PER_PROMPT  # --limit-mm-per-prompt's "image"

    def __post_init__(self) -> None:
        if self.max_image_bytes < 1:
            raise ValueError("max_image_bytes must be at least 1")
        if not self.fetch_timeout_s > 0:
            raise ValueError("fetch_timeout_s must be positive")
        if not 1 <= self.max_image_pixels <= PIL_MAX_IMAGE_PIXELS:
            raise ValueError(
                f"max_image_pixels must be between 1 and {PIL_MAX_IMAGE_PIXELS} (PIL's own guard)"
            )
        if self.max_images_per_prompt < 0:
            raise ValueError("max_images_per_prompt must not be negative")
        if self.allowed_local_media_path is not None and not self.allowed_local_media_path.is_dir():
            raise ValueError(
                f"allowed_local_media_path {str(self.allowed_local_media_path)!r} is not a folder"
            )
        # Host names compare lowercase (DNS is case-insensitive).
        object.__setattr__(
            self, "allowed_media_domains", tuple(d.strip().lower() for d in self.allowed_media_domains)
        )

    @classmethod
    def from_config(cls, config: MultiModalConfig) -> MediaPolicy:
        """The policy of the config's image section (ValueError when its folder does not exist here)."""
        folder = config.allowed_local_media_path
        return cls(
            allowed_media_domains=config.allowed_media_domains,
            allowed_local_media_path=None if folder is None else Path(folder),
            max_image_bytes=config.max_image_bytes,
            fetch_timeout_s=config.media_fetch_timeout,
            max_image_pixels=config.max_image_pixels,
            max_images_per_prompt=config.max_images_per_prompt,
        )

    def check_count(self, params: Sequence[str]) -> None:
        """MediaError naming the first image past the per-prompt limit (`params`: every image's field)."""
        limit = self.max_images_per_prompt
        if len(params) > limit:
            what = "takes no images" if limit == 0 else f"takes at most {limit} images per prompt"
            raise MediaError(
                f"the prompt has {len(params)} images; the server {what} (--limit-mm-per-prompt)",
                params[limit],
            )


def load_image(url: str, policy: MediaPolicy, field: str) -> Image.Image:
    """The RGB image `url` names, fully decoded; a MediaError naming `field` when it is refused. Blocking (a
    fetch waits up to the policy's timeout): the server calls `load_image_async`."""
    kind = _scheme(url, field)
    if kind == "data":
        data = _data_url_bytes(url, policy, field)
    elif kind == "file":
        data = _file_bytes(url, policy, field)
    else:
        data = _fetch_sync(_allowed_http_url(url, policy, field), policy, field)
    return decode_image(data, policy, field)


async def load_image_async(url: str, policy: MediaPolicy, field: str) -> Image.Image:
    """`load_image` without blocking the event loop: http(s) fetched with the async client, files read and
    images decoded on a worker thread."""
    kind = _scheme(url, field)
    if kind == "http":
        data = await _fetch_async(_allowed_http_url(url, policy, field), policy, field)
        return await asyncio.to_thread(decode_image, data, policy, field)
    return await asyncio.to_thread(load_image, url, policy, field)


async def load_images_async(refs: Sequence[tuple[str, str]], policy: MediaPolicy) -> list[Image.Image]:
    """Every (url, field) of a prompt loaded concurrently, in order; the per-prompt limit is checked first. The
    first refusal is raised once the others are cancelled."""
    policy.check_count([field for _, field in refs])
    tasks = [asyncio.ensure_future(load_image_async(url, policy, field)) for url, field in refs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


def image_from_object(value: object, policy: MediaPolicy, field: str) -> Image.Image:
    """An offline image: a PIL image (checked against the pixel cap, made RGB) or a URL string (`load_image`)."""
    if isinstance(value, str):
        return load_image(value, policy, field)
    if isinstance(value, Image.Image):
        _check_pixels(value.width, value.height, policy, field)
        value.load()
        return _to_rgb(value)
    raise MediaError(f"{field}: expected a PIL image or an image URL, got {type(value).__name__}", field)


def decode_image(data: bytes, policy: MediaPolicy, field: str) -> Image.Image:
    """The RGB image of encoded PNG, JPEG or WebP bytes; the pixel cap is checked from the header, before
    decoding."""
    if len(data) > policy.max_image_bytes:
        raise _too_many_bytes(field, policy)
    kind = sniff_format(data)
    if kind is None:
        raise MediaError(f"{field}: the bytes are not a PNG, JPEG or WebP image", field)
    if kind not in ALLOWED_FORMATS:
        raise MediaError(f"{field}: a {kind} image; only PNG, JPEG and WebP are taken", field)
    try:
        # Reads the header only: size without decoding. PIL's own bomb check (over twice its cap) raises here.
        image = Image.open(io.BytesIO(data), formats=[kind])
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise MediaError(
            f"{field}: the image has more pixels than --max-image-pixels ({policy.max_image_pixels})", field
        ) from exc
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise MediaError(f"{field}: the bytes are not a readable {kind} image", field) from exc
    _check_pixels(image.width, image.height, policy, field)
    try:
        image.load()
    except (OSError, ValueError, SyntaxError, EOFError) as exc:  # truncated or corrupt data
        raise MediaError(f"{field}: the {kind} image is truncated or corrupt", field) from exc
    return _to_rgb(image)


def sniff_format(data: bytes) -> str | None:
    """The image format its leading bytes name (PIL's format names), None when none is known."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    for signature, name in _SIGNATURES:
        if data.startswith(signature):
            return name
    return None


def _check_pixels(width: int, height: int, policy: MediaPolicy, field: str) -> None:
    if width * height > policy.max_image_pixels:
        raise MediaError(
            f"{field}: the image is {width}x{height} = {width * height} pixels, more than --max-image-pixels "
            f"({policy.max_image_pixels})",
            field,
        )


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB; transparent pixels over white (as vLLM does), not over whatever colour they hide."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _scheme(url: str, field: str) -> str:
    """ "data", "file" or "http" (http and https); a MediaError for any other scheme."""
    head = url[:8].lower()
    if head.startswith("data:"):
        return "data"
    if head.startswith("file:"):
        return "file"
    if head.startswith(("http://", "https://")):
        return "http"
    raise MediaError(
        f"{field}: the image URL must be a data:, http(s):// or file:// URL (got {url[:32]!r})", field
    )


def _too_many_bytes(field: str, policy: MediaPolicy) -> MediaError:
    return MediaError(
        f"{field}: the image is larger than --max-image-bytes ({policy.max_image_bytes})", field
    )


def _data_url_bytes(url: str, policy: MediaPolicy, field: str) -> bytes:
    """The bytes of a `data:image/...;base64,...` URL, strictly decoded; the size is checked before decoding."""
    header, sep, payload = url.partition(",")
    if not sep:
        raise MediaError(f"{field}: a data URL needs a ',' before its data", field)
    media = header[len("data:") :].split(";")
    if "base64" not in (p.strip().lower() for p in media[1:]):
        raise MediaError(f"{field}: a data URL must be base64 (data:image/png;base64,...)", field)
    media_type = media[0].strip().lower()
    if media_type and not media_type.startswith("image/"):
        raise MediaError(f"{field}: the data URL's media type {media_type!r} is not an image", field)
    if len(payload) // 4 * 3 > policy.max_image_bytes + 2:
        raise _too_many_bytes(field, policy)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"{field}: the data URL's base64 is invalid ({exc})", field) from exc


def _file_bytes(url: str, policy: MediaPolicy, field: str) -> bytes:
    """A file:// image under the allowed folder, symlinks and `..` resolved before the check."""
    root = policy.allowed_local_media_path
    if root is None:
        raise MediaError(
            f"{field}: file:// images are refused (the server has no --allowed-local-media-path)", field
        )
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
        raise MediaError(f"{field}: a file:// URL names a local path only (file:///path/to/image.png)", field)
    try:
        path = Path(unquote(parts.path)).resolve(strict=True)
        allowed = root.resolve(strict=True)
    except (OSError, RuntimeError, ValueError) as exc:
        raise MediaError(f"{field}: no such file", field) from exc
    if not path.is_relative_to(allowed) or not path.is_file():
        raise MediaError(f"{field}: the file is not under --allowed-local-media-path", field)
    with path.open("rb") as f:
        data = f.read(policy.max_image_bytes + 1)
    if len(data) > policy.max_image_bytes:
        raise _too_many_bytes(field, policy)
    return data


def _allowed_http_url(url: str | httpx.URL, policy: MediaPolicy, field: str) -> httpx.URL:
    """The parsed URL when its host is allowed (parsed by httpx, the client that connects, so both read the same
    host); a MediaError before any connection otherwise."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError) as exc:
        raise MediaError(f"{field}: the image URL is not a valid URL", field) from exc
    if parsed.scheme not in ("http", "https"):
        raise MediaError(f"{field}: a redirect left http(s)", field)
    if parsed.userinfo:
        raise MediaError(f"{field}: an image URL must not carry credentials", field)
    host = parsed.host.lower().rstrip(".")
    if not host or host not in policy.allowed_media_domains:
        raise MediaError(
            f"{field}: the host {host!r} is not in --allowed-media-domains; send the image as a data: URL",
            field,
        )
    return parsed


def _client_args(policy: MediaPolicy) -> dict[str, object]:
    # No proxies or .netrc from the environment: the connection goes to the allowed host itself.
    return {"timeout": policy.fetch_timeout_s, "follow_redirects": False, "trust_env": False}


def _next_url(response: httpx.Response, policy: MediaPolicy, field: str) -> httpx.URL | None:
    """The allowed redirect target of a 3xx response, None for a 200; a MediaError for anything else."""
    if response.is_redirect:
        location = response.headers.get("location")
        if location is None:
            raise MediaError(f"{field}: the image URL redirected without a location", field)
        return _allowed_http_url(response.url.join(location), policy, field)
    if response.status_code != 200:
        raise MediaError(f"{field}: fetching the image answered HTTP {response.status_code}", field)
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > policy.max_image_bytes:
        raise _too_many_bytes(field, policy)
    return None


class _Body:
    """The bytes of a response as they arrive, refused past the byte cap or the deadline."""

    def __init__(self, policy: MediaPolicy, field: str, deadline: float) -> None:
        self.policy, self.field, self.deadline = policy, field, deadline
        self.chunks = bytearray()

    def add(self, chunk: bytes) -> None:
        """Append a chunk; MediaError past the byte cap or the whole fetch's timeout."""
        self.chunks += chunk
        if len(self.chunks) > self.policy.max_image_bytes:
            raise _too_many_bytes(self.field, self.policy)
        if time.monotonic() > self.deadline:
            raise _timed_out(self.field, self.policy)


def _timed_out(field: str, policy: MediaPolicy) -> MediaError:
    return MediaError(f"{field}: fetching the image took longer than {policy.fetch_timeout_s} s", field)


def _fetch_sync(url: httpx.URL, policy: MediaPolicy, field: str) -> bytes:
    deadline = time.monotonic() + policy.fetch_timeout_s
    try:
        with httpx.Client(**_client_args(policy)) as client:  # type: ignore[arg-type]
            for _ in range(MAX_REDIRECTS + 1):
                with client.stream("GET", url) as response:
                    target = _next_url(response, policy, field)
                    if target is None:
                        body = _Body(policy, field, deadline)
                        for chunk in response.iter_bytes():
                            body.add(chunk)
                        return bytes(body.chunks)
                    url = target
    except httpx.TimeoutException as exc:
        raise _timed_out(field, policy) from exc
    except httpx.HTTPError as exc:
        raise MediaError(f"{field}: fetching the image failed ({type(exc).__name__})", field) from exc
    raise MediaError(f"{field}: the image URL redirected more than {MAX_REDIRECTS} times", field)


async def _fetch_async(url: httpx.URL, policy: MediaPolicy, field: str) -> bytes:
    deadline = time.monotonic() + policy.fetch_timeout_s
    try:
        async with asyncio.timeout(policy.fetch_timeout_s):
            async with httpx.AsyncClient(**_client_args(policy)) as client:  # type: ignore[arg-type]
                for _ in range(MAX_REDIRECTS + 1):
                    async with client.stream("GET", url) as response:
                        target = _next_url(response, policy, field)
                        if target is None:
                            body = _Body(policy, field, deadline)
                            async for chunk in response.aiter_bytes():
                                body.add(chunk)
                            return bytes(body.chunks)
                        url = target
    except (httpx.TimeoutException, TimeoutError) as exc:
        raise _timed_out(field, policy) from exc
    except httpx.HTTPError as exc:
        raise MediaError(f"{field}: fetching the image failed ({type(exc).__name__})", field) from exc
    raise MediaError(f"{field}: the image URL redirected more than {MAX_REDIRECTS} times", field)
