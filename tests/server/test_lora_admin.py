"""Runtime LoRA behind the admin key (#43, findings 4 and 6), through a live `pagoda serve --enable-lora`:
load/unload are the admin's (403 to another key) while every key may use what the admin loaded; /v1/models shows
no server path to another key; one error text whether a folder exists or not; one folder under many names holds
one copy of its weights; a bad config value or a header declaring a huge tensor is a 400 read from the header
alone, with the same text in-process and from an engine-core process."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pagoda.server import testing
from pagoda.server.testing import make_tiny_model
from pagoda.server.testing.tiny_lora import make_tiny_lora

pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-base"
USER, ADMIN = "sk-lora-user", "sk-lora-admin"
RANK = 64
NAMES = 20  # one folder under this many names


class Folders:
    """A base model wide enough that an adapter's copy shows in the RSS (~4 MB), its adapter, and bad ones."""

    def __init__(self, root: Path) -> None:
        self.base = make_tiny_model(
            "llama", root / "base", hidden_size=512, intermediate_size=1024, max_position_embeddings=256
        )
        self.good = make_tiny_lora(self.base, root / "good", rank=RANK, seed=1)
        self.root = root

    def alpha_pattern(self) -> Path:
        """The good adapter with a non-numeric alpha_pattern value."""
        folder = self.root / "alpha"
        folder.mkdir(exist_ok=True)
        config = json.loads((self.good / "adapter_config.json").read_text())
        config["alpha_pattern"] = {"q_proj": "lots"}
        (folder / "adapter_config.json").write_text(json.dumps(config))
        (folder / "adapter_model.safetensors").write_bytes(
            (self.good / "adapter_model.safetensors").read_bytes()
        )
        return folder

    def huge(self, gib: int = 1) -> Path:
        """A sparse adapter file whose header declares one `gib` GiB lora_A (the disk holds almost nothing)."""
        folder = self.root / "huge"
        folder.mkdir(exist_ok=True)
        (folder / "adapter_config.json").write_text((self.good / "adapter_config.json").read_text())
        cols = gib * 2**30 // (4 * RANK)
        prefix = "base_model.model.model.layers.0.self_attn.q_proj"
        a_bytes, b_bytes = RANK * cols * 4, 512 * RANK * 4
        header = {
            f"{prefix}.lora_A.weight": {"dtype": "F32", "shape": [RANK, cols], "data_offsets": [0, a_bytes]},
            f"{prefix}.lora_B.weight": {
                "dtype": "F32",
                "shape": [512, RANK],
                "data_offsets": [a_bytes, a_bytes + b_bytes],
            },
        }
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        with (folder / "adapter_model.safetensors").open("wb") as out:
            out.write(struct.pack("<Q", len(text)) + text)
            out.truncate(8 + len(text) + a_bytes + b_bytes)  # a hole: no data written
        return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Folders:
    """Built once for the module."""
    return Folders(tmp_path_factory.mktemp("lora-admin"))


def _serve(folders: Folders, *extra: str) -> testing.LiveServer:
    flags = [
        "--kv-cache-gib", "0.05", "--dtype", "float32", "--api-key", USER, "--admin-api-key", ADMIN,
        "--enable-lora", "--lora-modules", f"a={folders.good}", "--max-loras", "2", "--max-lora-rank", str(RANK),
        "--max-cpu-loras", "32", "--allow-runtime-lora-updating", *extra,
    ]  # fmt: skip
    return testing.LiveServer(folders.base, flags, served_model_name=MODEL, ready_timeout=180, cwd=ROOT)


@pytest.fixture(scope="module")
def live(folders: Folders) -> Iterator[testing.LiveServer]:
    """The in-process engine."""
    server = _serve(folders)
    try:
        yield server
    finally:
        assert server.stop() == 0


def call(
    live: testing.LiveServer, key: str, path: str, body: dict[str, object] | None = None
) -> httpx.Response:
    """GET (no body) or POST `path` with `key`."""
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=live.base_url, headers=headers, timeout=120) as c:
        return c.get(path) if body is None else c.post(path, json=body)


def load(live: testing.LiveServer, key: str, name: str, path: Path | str) -> httpx.Response:
    """POST /v1/load_lora_adapter."""
    return call(live, key, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


def complete(live: testing.LiveServer, key: str, model: str) -> httpx.Response:
    """A two-token completion under `model`."""
    return call(live, key, "/v1/completions", {"model": model, "prompt": [5, 17, 42], "max_tokens": 2})


def rss_kib(live: testing.LiveServer, field: str = "VmRSS") -> int:
    """The server process's resident (or peak, VmHWM) memory."""
    for line in Path(f"/proc/{live.process.pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


def test_load_and_unload_are_the_admins(live: testing.LiveServer, folders: Folders) -> None:
    """Another key gets a 403 (no folder read, nothing changed); the admin's load serves every key."""
    refused = load(live, USER, "mine", folders.good)
    assert refused.status_code == 403, refused.text
    assert "admin" in refused.json()["error"]["message"]
    assert call(live, USER, "/v1/unload_lora_adapter", {"lora_name": "a"}).status_code == 403
    assert complete(live, USER, "a").status_code == 200  # `a` is still served
    assert complete(live, USER, "mine").status_code == 404
    assert load(live, ADMIN, "shared", folders.good).status_code == 200
    assert complete(live, USER, "shared").status_code == 200
    assert call(live, USER, "/v1/unload_lora_adapter", {"lora_name": "shared"}).status_code == 403
    assert call(live, ADMIN, "/v1/unload_lora_adapter", {"lora_name": "shared"}).status_code == 200


def test_models_shows_no_server_path_to_another_key(live: testing.LiveServer, folders: Folders) -> None:
    """No field of another key's /v1/models holds an absolute path (the base's root included); the admin's
    shows the folders."""
    user = call(live, USER, "/v1/models").json()["data"]
    text = json.dumps(user)
    assert str(folders.root) not in text and '"/' not in text, text
    assert {card["id"]: card["root"] for card in user} == {MODEL: MODEL, "a": "a"}
    admin = {card["id"]: card["root"] for card in call(live, ADMIN, "/v1/models").json()["data"]}
    assert admin == {MODEL: str(folders.base), "a": str(folders.good)}


def test_one_error_text_whether_a_path_exists_or_not(live: testing.LiveServer, folders: Folders) -> None:
    """Missing, a file, an empty folder, a folder whose config is a directory: one text (bar the path)."""
    odd = folders.root / "odd"
    (odd / "adapter_config.json").mkdir(parents=True, exist_ok=True)
    empty = folders.root / "empty"
    empty.mkdir(exist_ok=True)
    paths = [folders.root / "no-such", folders.good / "adapter_config.json", empty, odd, Path("/proc/1/root")]
    texts = set()
    for path in paths:
        response = load(live, ADMIN, "probe", path)
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert error["param"] == "lora_path"
        texts.add(error["message"].replace(str(path), "<path>"))
    assert len(texts) == 1, texts
    assert complete(live, USER, "a").status_code == 200


def test_one_folder_under_many_names_holds_one_copy(live: testing.LiveServer, folders: Folders) -> None:
    """20 names of one folder, all registered at once (--max-cpu-loras 32): the RSS grows by far less than 20
    copies (~4 MB each, ~80 MB unshared), and each name serves."""
    assert load(live, ADMIN, "twin-0", folders.good).status_code == 200
    assert complete(live, USER, "twin-0").status_code == 200
    before = rss_kib(live)
    for i in range(1, NAMES):
        assert load(live, ADMIN, f"twin-{i}", folders.good).status_code == 200
    grown_mib = (rss_kib(live) - before) / 1024
    assert grown_mib < 25, f"{NAMES} names of one folder grew the RSS by {grown_mib:.0f} MiB"
    for i in (1, NAMES - 1):
        assert complete(live, USER, f"twin-{i}").status_code == 200
    for i in range(NAMES):
        assert call(live, ADMIN, "/v1/unload_lora_adapter", {"lora_name": f"twin-{i}"}).status_code == 200


def test_a_header_declaring_a_huge_tensor_is_refused_before_reading(
    live: testing.LiveServer, folders: Folders
) -> None:
    """A 1 GiB lora_A in the header (a sparse file): a 400 from the header's shape, the peak RSS unmoved."""
    peak = rss_kib(live, "VmHWM")
    response = load(live, ADMIN, "huge", folders.huge())
    assert response.status_code == 400, response.text
    assert "do not fit the base projection" in response.json()["error"]["message"]
    grown_mib = (rss_kib(live, "VmHWM") - peak) / 1024
    assert grown_mib < 256, f"the refused load raised the peak RSS by {grown_mib:.0f} MiB"


def _alpha_error(live: testing.LiveServer, folders: Folders) -> str:
    response = load(live, ADMIN, "alpha", folders.alpha_pattern())
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "lora_path"
    return str(error["message"])


ALPHA_TEXT = "adapter_config.json: alpha_pattern['q_proj'] must be a number"


def test_a_non_numeric_alpha_pattern_is_a_400(live: testing.LiveServer, folders: Folders) -> None:
    """In-process: a 400 with the loader's text (a 500 before)."""
    assert _alpha_error(live, folders).endswith(ALPHA_TEXT)
    assert complete(live, USER, "a").status_code == 200


def test_engine_core_gives_the_same_text(folders: Folders) -> None:
    """With an engine-core process the same 400 and text (the raw exception text before)."""
    with _serve(folders, "--engine-core", "process") as core:
        assert _alpha_error(core, folders).endswith(ALPHA_TEXT)
        refused = load(core, USER, "mine", folders.good)
        assert refused.status_code == 403
        assert complete(core, USER, "a").status_code == 200
