"""Image loading (multimodal/media.py): every source that is allowed, and every refusal, named by field."""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path

import pytest
from media_support import Route, data_url, image_bytes, media_server, png_header_only
from pagoda.server.config import ModalityLimits, MultiModalConfig
from pagoda.server.multimodal.media import (
    MediaError,
    MediaPolicy,
    decode_image,
    image_from_object,
    load_image,
    load_image_async,
    load_images_async,
)
from PIL import Image

FIELD = "messages[0].content[1].image_url"


def refused(url: str, policy: MediaPolicy, match: str) -> MediaError:
    """The MediaError load_image raises (naming FIELD), its message matching `match`."""
    with pytest.raises(MediaError, match=match) as info:
        load_image(url, policy, FIELD)
    assert info.value.param == FIELD
    assert isinstance(info.value, ValueError)
    return info.value


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_data_url_of_each_format_loads_rgb(fmt: str) -> None:
    image = load_image(data_url(image_bytes(fmt, (9, 7))), MediaPolicy(), FIELD)
    assert (image.mode, image.size) == ("RGB", (9, 7))
    assert image.getpixel((4, 3))[0] > 150  # type: ignore[index]  # the red survived (JPEG and WebP are lossy)


def test_transparent_png_lands_on_white() -> None:
    out = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    buf = io.BytesIO()
    out.save(buf, format="PNG")
    image = load_image(data_url(buf.getvalue()), MediaPolicy(), FIELD)
    assert image.getpixel((0, 0)) == (255, 255, 255)


def test_bad_base64_is_refused() -> None:
    refused("data:image/png;base64,iVBOR!!!not-base64", MediaPolicy(), "base64 is invalid")
    # Whitespace inside the payload is not base64 either (strict decoding).
    payload = base64.b64encode(image_bytes()).decode()
    refused(f"data:image/png;base64,{payload[:8]} {payload[8:]}", MediaPolicy(), "base64 is invalid")


def test_data_url_shape_is_checked() -> None:
    refused("data:image/png," + "abc", MediaPolicy(), "must be base64")
    refused("data:image/png;base64", MediaPolicy(), "needs a ','")
    refused(data_url(image_bytes(), "text/plain"), MediaPolicy(), "is not an image")


def test_non_image_bytes_are_refused() -> None:
    refused(data_url(b"hello, not an image at all"), MediaPolicy(), "not a PNG, JPEG or WebP")
    # A PNG signature followed by garbage: named, refused, no crash.
    refused(data_url(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40), MediaPolicy(), "not a readable PNG")


@pytest.mark.parametrize(("fmt", "name"), [("GIF", "GIF"), ("BMP", "BMP"), ("TIFF", "TIFF")])
def test_other_formats_are_refused(fmt: str, name: str) -> None:
    refused(data_url(image_bytes(fmt)), MediaPolicy(), f"a {name} image; only PNG, JPEG and WebP")


def test_truncated_image_is_refused() -> None:
    data = image_bytes("PNG", (64, 64))
    refused(data_url(data[: len(data) // 2]), MediaPolicy(), "truncated or corrupt|not a readable")


def _watch_loads(monkeypatch: pytest.MonkeyPatch) -> list[Image.Image]:
    """Every image whose pixels get decoded (`Image.load`) from now on."""
    loaded: list[Image.Image] = []
    original = Image.Image.load

    def load(self: Image.Image) -> object:
        loaded.append(self)
        return original(self)

    monkeypatch.setattr(Image.Image, "load", load)
    return loaded


def test_pixel_cap_refuses_from_the_header(monkeypatch: pytest.MonkeyPatch) -> None:
    """A header claiming 5000x5000 (under PIL's own guard) is refused by the policy's cap without decoding:
    `load` is never called (and its data could not fill that size anyway)."""
    loaded = _watch_loads(monkeypatch)
    policy = MediaPolicy(max_image_pixels=4096 * 4096)
    error = refused(data_url(png_header_only(5000, 5000)), policy, "5000x5000 = 25000000 pixels")
    assert "--max-image-pixels" in str(error)
    assert loaded == []


def test_decompression_bomb_is_refused_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """100000x100000 (30 GB decoded) is refused from its header (PIL's own guard, or the policy's cap)."""
    loaded = _watch_loads(monkeypatch)
    refused(data_url(png_header_only(100_000, 100_000)), MediaPolicy(), "pixels.*--max-image-pixels")
    assert loaded == []


def test_image_at_the_pixel_cap_loads() -> None:
    policy = MediaPolicy(max_image_pixels=8 * 6)
    assert load_image(data_url(image_bytes("PNG", (8, 6))), policy, FIELD).size == (8, 6)
    refused(data_url(image_bytes("PNG", (8, 7))), policy, "more than --max-image-pixels")


def test_byte_cap_on_data_urls() -> None:
    data = image_bytes("PNG", (32, 32))
    policy = MediaPolicy(max_image_bytes=len(data) - 1)
    refused(data_url(data), policy, "larger than --max-image-bytes")
    assert load_image(data_url(data), MediaPolicy(max_image_bytes=len(data)), FIELD).size == (32, 32)


def test_other_schemes_are_refused() -> None:
    for url in ("ftp://example.com/a.png", "gopher://x", "/etc/passwd", "image.png", "javascript:alert(1)"):
        refused(url, MediaPolicy(), "must be a data:, http")


def test_policy_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="max_image_pixels"):
        MediaPolicy(max_image_pixels=10**9)
    with pytest.raises(ValueError, match="max_images_per_prompt"):
        MediaPolicy(max_images_per_prompt=-1)
    with pytest.raises(ValueError, match="fetch_timeout_s"):
        MediaPolicy(fetch_timeout_s=0)


def test_count_limit_names_the_first_image_over() -> None:
    policy = MediaPolicy(max_images_per_prompt=2)
    policy.check_count(["a", "b"])
    with pytest.raises(MediaError, match="3 images; the server takes at most 2") as info:
        policy.check_count(["a", "b", "c"])
    assert info.value.param == "c"
    with pytest.raises(MediaError, match="takes no images"):
        MediaPolicy(max_images_per_prompt=0).check_count(["a"])


# --- http(s) ---------------------------------------------------------------------------------------------


def test_disallowed_host_makes_no_connection() -> None:
    with media_server() as server:
        server.routes["/cat.png"] = Route(body=image_bytes())
        url = f"{server.url}/cat.png"
        refused(url, MediaPolicy(), "not in --allowed-media-domains")
        refused(url, MediaPolicy(allowed_media_domains=("example.com", "127.0.0.2")), "'127.0.0.1' is not in")
        # A subdomain or a suffix is not the host.
        refused(url, MediaPolicy(allowed_media_domains=("0.0.1",)), "not in")
        # Credentials in front of an allowed-looking name: the host is what comes after the '@'.
        port = server.url.rsplit(":", 1)[1]
        refused(
            f"http://127.0.0.1@localhost:{port}/cat.png",
            MediaPolicy(allowed_media_domains=("127.0.0.1",)),
            "must not carry credentials|'localhost' is not in",
        )
        with pytest.raises(MediaError):
            asyncio.run(load_image_async(url, MediaPolicy(), FIELD))
        assert server.requested == []


def test_allowed_host_is_fetched_sync_and_async() -> None:
    with media_server() as server:
        server.routes["/cat.png"] = Route(body=image_bytes("PNG", (5, 4)))
        policy = MediaPolicy(allowed_media_domains=("127.0.0.1",))
        assert load_image(f"{server.url}/cat.png", policy, FIELD).size == (5, 4)
        assert asyncio.run(load_image_async(f"{server.url}/cat.png", policy, FIELD)).size == (5, 4)
        assert server.requested == ["/cat.png", "/cat.png"]


def test_http_errors_and_non_images_are_named() -> None:
    with media_server() as server:
        server.routes["/text"] = Route(body=b"<html>not an image</html>")
        policy = MediaPolicy(allowed_media_domains=("127.0.0.1",))
        refused(f"{server.url}/missing.png", policy, "answered HTTP 404")
        refused(f"{server.url}/text", policy, "not a PNG, JPEG or WebP")


def test_redirect_to_another_host_is_not_followed() -> None:
    with media_server() as server:
        port = server.url.rsplit(":", 1)[1]
        server.routes["/away"] = Route(status=302, headers={"Location": f"http://localhost:{port}/cat.png"})
        server.routes["/here"] = Route(status=302, headers={"Location": "/cat.png"})
        server.routes["/cat.png"] = Route(body=image_bytes())
        policy = MediaPolicy(allowed_media_domains=("127.0.0.1",))
        refused(f"{server.url}/away", policy, "'localhost' is not in --allowed-media-domains")
        assert server.requested == ["/away"]
        # A redirect within the allowed host is followed.
        assert load_image(f"{server.url}/here", policy, FIELD).size == (8, 6)
        server.routes["/loop"] = Route(status=302, headers={"Location": "/loop"})
        refused(f"{server.url}/loop", policy, "redirected more than")


def test_fetch_byte_cap_with_and_without_content_length() -> None:
    data = image_bytes("PNG", (64, 64))
    with media_server() as server:
        server.routes["/sized.png"] = Route(body=data)
        server.routes["/unsized.png"] = Route(body=data, send_length=False)
        policy = MediaPolicy(allowed_media_domains=("127.0.0.1",), max_image_bytes=len(data) // 2)
        refused(f"{server.url}/sized.png", policy, "larger than --max-image-bytes")
        refused(f"{server.url}/unsized.png", policy, "larger than --max-image-bytes")
        with pytest.raises(MediaError, match="larger than --max-image-bytes"):
            asyncio.run(load_image_async(f"{server.url}/unsized.png", policy, FIELD))


def test_fetch_timeout() -> None:
    with media_server() as server:
        server.routes["/slow.png"] = Route(body=image_bytes(), delay_s=2.0)
        policy = MediaPolicy(allowed_media_domains=("127.0.0.1",), fetch_timeout_s=0.3)
        refused(f"{server.url}/slow.png", policy, "took longer than 0.3 s")
        with pytest.raises(MediaError, match=r"took longer than 0\.3 s"):
            asyncio.run(load_image_async(f"{server.url}/slow.png", policy, FIELD))


# --- file:// ---------------------------------------------------------------------------------------------


def test_file_urls_only_under_the_allowed_folder(tmp_path: Path) -> None:
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "cat.png").write_bytes(image_bytes("PNG", (3, 2)))
    (tmp_path / "secret.png").write_bytes(image_bytes())
    policy = MediaPolicy(allowed_local_media_path=allowed)
    assert load_image(f"file://{allowed}/cat.png", policy, FIELD).size == (3, 2)
    refused(f"file://{allowed}/cat.png", MediaPolicy(), "no --allowed-local-media-path")
    refused(f"file://{tmp_path}/secret.png", policy, "not under --allowed-local-media-path")
    refused(f"file://{allowed}/../secret.png", policy, "not under --allowed-local-media-path")
    refused(f"file://{allowed}/%2e%2e/secret.png", policy, "not under --allowed-local-media-path")
    refused(f"file://{allowed}/nothing.png", policy, "no such file")
    refused(f"file://{allowed}", policy, "not under")  # the folder itself is no file
    refused(f"file://otherhost{allowed}/cat.png", policy, "local path only")


def test_symlink_out_of_the_folder_is_refused(tmp_path: Path) -> None:
    allowed = tmp_path / "media"
    allowed.mkdir()
    (tmp_path / "secret.png").write_bytes(image_bytes())
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    (allowed / "sub").symlink_to(tmp_path)
    policy = MediaPolicy(allowed_local_media_path=allowed)
    refused(f"file://{allowed}/link.png", policy, "not under --allowed-local-media-path")
    refused(f"file://{allowed}/sub/secret.png", policy, "not under --allowed-local-media-path")


def test_file_byte_cap(tmp_path: Path) -> None:
    data = image_bytes("PNG", (32, 32))
    (tmp_path / "big.png").write_bytes(data)
    policy = MediaPolicy(allowed_local_media_path=tmp_path, max_image_bytes=len(data) - 1)
    refused(f"file://{tmp_path}/big.png", policy, "larger than --max-image-bytes")


# --- many images, offline objects -------------------------------------------------------------------------


def test_load_images_async_keeps_order_and_checks_the_limit() -> None:
    refs = [(data_url(image_bytes("PNG", (i + 1, 1))), f"f{i}") for i in range(3)]
    images = asyncio.run(load_images_async(refs, MediaPolicy()))
    assert [im.size for im in images] == [(1, 1), (2, 1), (3, 1)]
    with pytest.raises(MediaError) as info:
        asyncio.run(load_images_async(refs, MediaPolicy(max_images_per_prompt=2)))
    assert info.value.param == "f2"
    bad = [refs[0], ("data:image/png;base64,@@", "f1")]
    with pytest.raises(MediaError) as info:
        asyncio.run(load_images_async(bad, MediaPolicy()))
    assert info.value.param == "f1"


def test_image_objects_offline() -> None:
    rgba = Image.new("RGBA", (4, 3), (0, 0, 255, 255))
    image = image_from_object(rgba, MediaPolicy(), "image")
    assert (image.mode, image.size, image.getpixel((0, 0))) == ("RGB", (4, 3), (0, 0, 255))
    with pytest.raises(MediaError, match="more than --max-image-pixels"):
        image_from_object(Image.new("RGB", (10, 10)), MediaPolicy(max_image_pixels=99), "image")
    with pytest.raises(MediaError, match="expected a PIL image"):
        image_from_object(b"bytes", MediaPolicy(), "image")


def test_decode_image_refuses_empty_bytes() -> None:
    with pytest.raises(MediaError, match="not a PNG"):
        decode_image(b"", MediaPolicy(), FIELD)


def test_policy_from_config(tmp_path: Path) -> None:
    config = MultiModalConfig(
        limit_mm_per_prompt=ModalityLimits(image=2),
        allowed_media_domains=("A.org",),
        allowed_local_media_path=str(tmp_path),
        max_image_bytes=10,
        media_fetch_timeout=1.5,
        max_image_pixels=100,
    )
    assert MediaPolicy.from_config(config) == MediaPolicy(("a.org",), tmp_path, 10, 1.5, 100, 2)
    with pytest.raises(ValueError, match="is not a folder"):
        MediaPolicy.from_config(MultiModalConfig(allowed_local_media_path=str(tmp_path / "none")))
