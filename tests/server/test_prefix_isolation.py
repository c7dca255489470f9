"""The prefix cache is no oracle across API keys: each key's prompts hit only its own cached blocks, and
`cache_salt` (vLLM's) splits sharing further. Live servers over a tiny model, driven by the official client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from api_cases import MODEL
from pagoda.blockalloc.hashing import ROOT_BLOCK_HASH, hash_blocks, salt_bytes
from pagoda.server.api.cache_scope import combine, key_digest
from pagoda.server.cli import build_parser, serve_config
from pagoda.server.routing import ReplicaLoad
from pagoda.server.routing.cache_aware import CacheAwareRouter
from pagoda.server.testing import make_tiny_model
from test_api_live import LiveServer, serving

KEY_A, KEY_B, KEY_C = "sk-tenant-a", "sk-tenant-b", "sk-tenant-c"


def _client(live: LiveServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.base_url}/v1", api_key=key, max_retries=0, timeout=120)


def _cached(client: openai.OpenAI, prompt: list[int], **extra: object) -> int:
    """`cached_tokens` of a one-token completion of `prompt`."""
    result = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body=dict(extra) or None
    )
    assert result.usage is not None and result.usage.prompt_tokens_details is not None
    return result.usage.prompt_tokens_details.cached_tokens or 0


def _prompt(start: int) -> list[int]:
    return [start + i for i in range(66)]  # four full blocks of 16 and two tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def live(model_dir: Path) -> Iterator[LiveServer]:
    """Two API keys, the prefix cache isolated per key (the default)."""
    with serving(model_dir, "--api-key", KEY_A, "--api-key", KEY_B) as server:
        yield server


def test_a_keys_repeated_prompt_hits_only_its_own_cache(live: LiveServer) -> None:
    """Key A's second send hits its blocks; key B sending the same prompt sees nothing cached."""
    a, b = _client(live, KEY_A), _client(live, KEY_B)
    prompt = _prompt(100)
    assert _cached(a, prompt) == 0
    assert _cached(a, prompt) >= 64
    assert _cached(b, prompt) == 0
    assert _cached(b, prompt) >= 64  # B's own send is cached for B


def test_cache_salt_shares_only_between_equal_salts(live: LiveServer) -> None:
    """Equal `cache_salt`s share cached prefixes, different ones (or none) do not; chat takes the field too."""
    a = _client(live, KEY_A)
    prompt = _prompt(300)
    assert _cached(a, prompt, cache_salt="team-1") == 0
    assert _cached(a, prompt, cache_salt="team-1") >= 64
    assert _cached(a, prompt, cache_salt="team-2") == 0
    assert _cached(a, prompt) == 0
    chat = a.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "salted " * 40}],
        max_tokens=1,
        extra_body={"cache_salt": "team-3"},
    )
    assert chat.choices[0].message is not None


@pytest.mark.parametrize("value", [5, ["x"], "", {"a": 1}])
def test_bad_cache_salt_is_a_400_naming_it(live: LiveServer, value: object) -> None:
    """A non-string (or empty) salt is a 400 naming `cache_salt`; the server keeps serving."""
    a = _client(live, KEY_A)
    with pytest.raises(openai.BadRequestError) as info:
        a.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={"cache_salt": value})
    assert isinstance(info.value.body, dict) and info.value.body.get("param") == "cache_salt"
    assert _cached(a, [7, 8, 9]) == 0


def test_key_file_and_shared_cache_when_isolation_is_off(model_dir: Path, tmp_path: Path) -> None:
    """`--api-key-file` adds keys; `--no-isolate-prefix-cache-per-key` lets every key share the cache again."""
    keys = tmp_path / "keys"
    keys.write_text(f"# tenants\n{KEY_B}\n\n{KEY_C}\n")
    flags = ("--api-key", KEY_A, "--api-key-file", str(keys), "--no-isolate-prefix-cache-per-key")
    with serving(model_dir, *flags) as live:
        prompt = _prompt(200)
        assert _cached(_client(live, KEY_A), prompt) == 0
        assert _cached(_client(live, KEY_C), prompt) >= 64
        with pytest.raises(openai.AuthenticationError):
            _client(live, "sk-other").models.list()


def test_unreadable_key_file_is_a_flag_error(tmp_path: Path) -> None:
    """A missing or empty key file is a ValueError naming --api-key-file (the CLI exits 2 with it)."""
    empty = tmp_path / "empty"
    empty.write_text("# none\n\n")
    for path in (tmp_path / "missing", empty):
        with pytest.raises(ValueError, match="--api-key-file"):
            serve_config(build_parser().parse_args(["serve", "--api-key-file", str(path)]))
    with pytest.raises(ValueError, match="--api-key"):
        serve_config(build_parser().parse_args(["serve", "--api-key", " "]))


def test_salts_fold_unambiguously() -> None:
    """No key scope and salt pair folds like another; none of either is the shared cache (None)."""
    assert combine(None, None) is None
    folded = {combine(s, c) for s in (None, "a", "a,b") for c in (None, "a", "b", "a,b")} - {None}
    assert len(folded) == 11
    assert key_digest(b"k1") != key_digest(b"k2") and KEY_A not in key_digest(KEY_A.encode())


def test_cache_aware_router_hashes_with_the_salt() -> None:
    """The router matches a prompt's blocks only under the same salt, as the engine's prefix cache does."""
    router = CacheAwareRouter(2, 4)
    loads = [ReplicaLoad(True, 0, 0, 0, 0.0), ReplicaLoad(True, 0, 0, 0, 0.0)]
    prompt = list(range(32))
    first = router.route(prompt, loads, salt="s1")
    assert router.route(prompt, loads, salt="s1") == first and router.hits == 1
    router.route(prompt, loads, salt="s2")
    router.route(prompt, loads)
    assert router.hits == 1 and router.misses == 3
    # The index holds the engine's own chain for the salt.
    hashes = hash_blocks(prompt, 4, 0, 8, ROOT_BLOCK_HASH, salt_bytes("s1"))
    assert router._indexes[first].match(hashes) == 8
