"""The image flags of `pagoda serve` (issue 38): they land in MultiModalConfig; bad values exit 2 naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest
from pagoda.server.cli import build_parser, main, serve_config
from pagoda.server.config import (
    DEFAULT_MAX_IMAGES_PER_PROMPT,
    EngineConfig,
    ModalityLimits,
    MultiModalConfig,
    parse_limit_mm_per_prompt,
)


def _exit_status(argv: list[str]) -> int:
    """`main`'s status, whether argparse exits (a bad flag type) or the config refuses (a bad value)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def test_defaults() -> None:
    config = serve_config(build_parser().parse_args(["serve"])).engine.multimodal_config
    assert config == MultiModalConfig()
    assert config.max_images_per_prompt == DEFAULT_MAX_IMAGES_PER_PROMPT
    assert (config.allowed_media_domains, config.allowed_local_media_path) == ((), None)


def test_flags_map_onto_the_config(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--limit-mm-per-prompt",
            '{"image": 3}',
            "--allowed-media-domains",
            "upload.wikimedia.org",
            "Images.Example.COM",
            "--allowed-local-media-path",
            str(tmp_path),
            "--max-image-bytes",
            "1000",
            "--media-fetch-timeout",
            "2.5",
            "--max-image-pixels",
            "65536",
        ]
    )
    assert serve_config(args).engine.multimodal_config == MultiModalConfig(
        limit_mm_per_prompt=ModalityLimits(image=3),
        allowed_media_domains=("upload.wikimedia.org", "images.example.com"),
        allowed_local_media_path=str(tmp_path),
        max_image_bytes=1000,
        media_fetch_timeout=2.5,
        max_image_pixels=65536,
    )
    assert serve_config(args).engine.multimodal_config.max_images_per_prompt == 3


def test_offline_keywords_take_vllms_dict() -> None:
    config = EngineConfig.from_flat(limit_mm_per_prompt={"image": 0}, allowed_media_domains=["a.org"])
    assert config.multimodal_config.max_images_per_prompt == 0
    assert config.multimodal_config.allowed_media_domains == ("a.org",)
    assert parse_limit_mm_per_prompt("{}") == ModalityLimits()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--limit-mm-per-prompt", "{image: 2}"], "limit_mm_per_prompt is not valid JSON"),
        (["--limit-mm-per-prompt", "[2]"], "must be a JSON object"),
        (["--limit-mm-per-prompt", '{"video": 1}'], "unknown modality 'video'"),
        (["--limit-mm-per-prompt", '{"image": -1}'], "image must be a count >= 0"),
        (["--limit-mm-per-prompt", '{"image": 1.5}'], "image must be a count >= 0"),
        (["--limit-mm-per-prompt", '{"image": true}'], "image must be a count >= 0"),
        (["--allowed-local-media-path", "/no/such/folder"], "is not an existing folder"),
        (["--max-image-pixels", "0"], "--max-image-pixels"),
        (["--max-image-pixels", "100000000"], "PIL's own guard"),
        (["--max-image-bytes", "0"], "--max-image-bytes"),
        (["--media-fetch-timeout", "0"], "--media-fetch-timeout"),
        (["--allowed-media-domains", "http://a.org/x"], "--allowed-media-domains"),
    ],
)
def test_bad_values_exit_2(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before any model loads, naming the flag (argparse's own message names it for a bad type)."""
    assert _exit_status(["serve", "unused-model", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert flags[0] in err


def test_a_file_is_not_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "f").write_text("x")
    assert _exit_status(["serve", "unused-model", "--allowed-local-media-path", str(tmp_path / "f")]) == 2
    assert "--allowed-local-media-path" in capsys.readouterr().err
