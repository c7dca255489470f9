"""The cheap checks before tokenizing: the prompt-length bound is sound, and lone surrogates are found anywhere."""

from __future__ import annotations

from pathlib import Path

import pytest
from api_fake_engine import make_char_tokenizer
from pagoda.server.api.input_checks import first_lone_surrogate, max_chars_per_token, max_prompt_chars
from pagoda.server.testing import make_tiny_tokenizer
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

TEXTS = [
    "hello world " * 50,
    " " * 400,
    "\n\n\t  \u3000" * 60,
    "zzzzqqqqxxxx" * 40,
    "日本語のテキスト、絵文字😀と混ざった文" * 20,
    "The quick brown fox jumps over the lazy dog. " * 30,
    "".join(chr(c) for c in range(32, 2000)),
]


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    """The byte-level BPE tokenizer of the tiny test models."""
    path: Path = tmp_path_factory.mktemp("tokenizer")
    make_tiny_tokenizer(path)
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(path)
    return tokenizer


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_the_bound_never_overcounts(tiny_tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    """A text of c characters has at least c / L tokens, L being the bound per token: the bound never rejects a
    prompt that fits."""
    per_token = max_chars_per_token(tiny_tokenizer)
    assert per_token is not None and per_token >= 1
    num_tokens = len(tiny_tokenizer.encode(text, add_special_tokens=False))
    assert num_tokens * per_token >= len(text)
    assert max_prompt_chars(tiny_tokenizer, 64) == 64 * per_token


def _fast(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)  # type: ignore[no-untyped-call]


def test_no_bound_where_text_can_vanish_into_few_tokens() -> None:
    """Tokenizers that drop characters or map a run of text to one token get no bound at all."""
    vocab = {"a": 0, "b": 1, "[UNK]": 2}
    whitespace = Tokenizer(models.BPE(vocab, [], unk_token="[UNK]"))
    whitespace.pre_tokenizer = pre_tokenizers.Whitespace()  # drops the spaces
    stripping = Tokenizer(models.BPE(vocab, []))
    stripping.normalizer = normalizers.Strip()
    wordpiece = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))  # a whole unknown word is one token
    fused = Tokenizer(models.BPE(vocab, [], unk_token="[UNK]", fuse_unk=True))
    for tokenizer in (whitespace, stripping, wordpiece, fused):
        assert max_chars_per_token(_fast(tokenizer)) is None
    assert max_chars_per_token(make_char_tokenizer()) is None  # WordLevel


def test_first_lone_surrogate_paths() -> None:
    """The path of the first string holding a lone surrogate, in values, lists and keys, at any depth."""
    assert first_lone_surrogate({"prompt": "fine", "stop": ["x", "\U0001f600"]}) is None
    assert first_lone_surrogate({"prompt": ["ok", "a\udc00"]}) == ("prompt", "1")
    assert first_lone_surrogate({"messages": [{"content": "\ud800"}]}) == ("messages", "0", "content")
    assert first_lone_surrogate({"x\ud800": 1}) == ()
    deep: object = "\ud800"
    for _ in range(100_000):
        deep = [deep]
    assert first_lone_surrogate({"a": deep}) == ("a", *["0"] * 100_000)
