"""Cheap checks of request text that run before any tokenization: lone surrogates, a sound length bound."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from transformers import PreTrainedTokenizerBase

# Normalizers and pre-tokenizers that never shorten the text (so every character still reaches a token).
_LENGTH_KEEPING_NORMALIZERS = {"Prepend", "Replace", "Sequence"}
_LENGTH_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "Sequence"}


def _keeps_length(node: Mapping[str, Any] | None, allowed: set[str]) -> bool:
    if node is None:
        return True
    kind = node.get("type")
    if kind not in allowed:
        return False
    if kind == "Sequence":
        children = node.get("normalizers") or node.get("pretokenizers") or []
        return all(_keeps_length(child, allowed) for child in children)
    if kind == "Replace":  # only a literal pattern replaced by content at least as long
        pattern = node.get("pattern", {})
        return "String" in pattern and len(node.get("content", "")) >= len(pattern["String"])
    if kind == "Split":
        return node.get("behavior") != "Removed"
    return True


def max_chars_per_token(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The most characters of prompt text one token can stand for, or None when no sound bound is known.

    A BPE whose normalizer and pre-tokenizer never drop characters turns every character (byte, for byte-level
    BPE) into part of exactly one token, and no token is longer than the longest vocabulary entry; so a text of
    c characters has at least c / L tokens. Models that map a run of unknown text to one token (WordPiece,
    Unigram, fused unknowns) or added tokens that swallow whitespace (lstrip, rstrip) get no bound.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    # Each part read on its own: the whole tokenizer's JSON (to_str, 33 MB for Gemma 3) took 2-3 s to write and
    # parse at every start.
    model = backend.model
    if type(model).__name__ != "BPE" or (model.fuse_unk and not model.byte_fallback):
        return None
    if not _keeps_length(_state(backend.normalizer), _LENGTH_KEEPING_NORMALIZERS):
        return None
    if not _keeps_length(_state(backend.pre_tokenizer), _LENGTH_KEEPING_PRE_TOKENIZERS):
        return None
    added = backend.get_added_tokens_decoder().values()
    if any(token.lstrip or token.rstrip for token in added):
        return None
    # Token by token rather than `get_vocab()`: one Rust call that holds the GIL for 0.2-0.4 s (262k tokens), where
    # this loop lets the server's other threads run between tokens (it runs in the background, once serving).
    token_of = backend.id_to_token
    longest = max(
        (len(token_of(i) or "") for i in range(backend.get_vocab_size(with_added_tokens=True))), default=1
    )
    return max(1, longest, *(len(token.content) for token in added))


def _state(component: Any) -> Mapping[str, Any] | None:
    """A tokenizer component's (normalizer, pre-tokenizer) serialized spec, as in tokenizer.json; None: none."""
    if component is None:
        return None
    state: Mapping[str, Any] = json.loads(component.__getstate__())
    return state


def max_prompt_chars(tokenizer: PreTrainedTokenizerBase, max_model_len: int) -> int | None:
    """Prompt texts longer than this (in characters) have more than max_model_len tokens; None: no bound."""
    per_token = max_chars_per_token(tokenizer)
    return None if per_token is None else per_token * max_model_len


def first_lone_surrogate(data: Any) -> tuple[str, ...] | None:
    """Where parsed JSON holds a string (key or value) with a lone UTF-16 surrogate: the path of the value or
    of the object whose key it is (() for the body itself); None if nowhere.

    JSON may escape a surrogate half alone ("\\ud800"); Python then holds a str that cannot be encoded, which
    the tokenizer and every response would fail on. Walks without recursion: the data may be deep.
    """
    # Each entry links to its parent's path, so that the walk stays linear in the depth.
    stack: list[tuple[_Path, Any]] = [(None, data)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, str):
            if _has_surrogate(node):
                return _unlink(path)
        elif isinstance(node, dict):
            for key, value in node.items():
                if _has_surrogate(key):
                    return _unlink(path)
                stack.append(((key, path), value))
        elif isinstance(node, list):
            stack.extend(((str(i), path), value) for i, value in enumerate(node))
    return None


_Path = tuple[str, "_Path"] | None


def _unlink(path: _Path) -> tuple[str, ...]:
    parts: list[str] = []
    while path is not None:
        parts.append(path[0])
        path = path[1]
    return tuple(reversed(parts))


def _has_surrogate(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
