"""Incremental decoding of one sample's tokens into text, correct across characters split over tokens.

Both streams are primed with the end of the prompt, so the first generated token decodes in context (a
sentencepiece "▁word" keeps its space, a character whose bytes span the prompt's last token and the first
generated one decodes whole), and both hold back text while it ends in an incomplete UTF-8 sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

# Prompt tokens decoded as context before the first generated token, and the context a restarted stream keeps:
# enough for the longest byte run of one character (4) plus a word boundary.
CONTEXT_TOKENS = 8
_INCOMPLETE = "\ufffd"  # what decoding shows for a trailing partial UTF-8 sequence
_INVALID_PREFIX = "Invalid prefix"  # tokenizers' DecodeStream error when a decoder is not prefix-stable


class TextStream(Protocol):
    """Turns tokens, as they arrive, into the text they add."""

    def step(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete (may be empty while a character is incomplete)."""
        ...


def _is_invalid_prefix(error: Exception) -> bool:
    """True for DecodeStream's recoverable error (its type is a bare Exception)."""
    return str(error).startswith(_INVALID_PREFIX)


class FastTextStream:
    """A `tokenizers.decoders.DecodeStream` over the Rust tokenizer, restarted on its invalid-prefix error.

    DecodeStream re-decodes a short window of recent tokens and raises when the window's text no longer
    extends what it showed, which byte-fallback decoders do: an invalid byte run turns into U+FFFD as a whole,
    bytes already shown included. Shown text cannot be taken back, so we show the unshown tokens' own text
    and go on with a fresh stream primed with the recent tokens.
    """

    def __init__(self, tokenizer: Tokenizer, context: Sequence[int], skip_special_tokens: bool) -> None:
        """Prime a stream with the last CONTEXT_TOKENS `context` ids (the prompt); their text is dropped."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._context: list[int] = []  # recent ids whose text is out: what a restarted stream is primed with
        self._pending: list[int] = []  # ids stepped since text last came out
        self._stream = self._primed(context[-CONTEXT_TOKENS:])

    def step(self, token_ids: Sequence[int]) -> str:
        """Append tokens and return the text they complete."""
        chunks = []
        for token_id in token_ids:
            try:
                chunk = self._stream.step(self._tokenizer, token_id)
            except Exception as error:
                if not _is_invalid_prefix(error):
                    raise
                chunk = self._restart(token_id)
            self._pending.append(token_id)
            if chunk is not None:
                self._context = [*self._context, *self._pending][-CONTEXT_TOKENS:]
                self._pending = []
                chunks.append(chunk)
        return "".join(chunks)

    def _primed(self, context: Sequence[int]) -> DecodeStream:
        """A fresh stream that has consumed the longest suffix of `context` it accepts."""
        for start in range(len(context)):
            stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            try:
                for token_id in context[start:]:
                    stream.step(self._tokenizer, token_id)
            except Exception as error:
                if not _is_invalid_prefix(error):
                    raise
                continue
            return stream
        return DecodeStream(skip_special_tokens=self._skip_special_tokens)

    def _restart(self, token_id: int) -> str:
        """Replace the failed stream by one that has seen the new token; return the unshown tokens' text."""
        unshown = [*self._pending, token_id]
        self._stream = self._primed([*self._context, *unshown][-CONTEXT_TOKENS:])
        return self._tokenizer.decode(unshown, skip_special_tokens=self._skip_special_tokens)


class OffsetTextStream:
    """vLLM's prefix/read offsets over `tokenizer.decode`, for tokenizers without a Rust backend.

    Text is emitted as decode(window + new)[len(decode(window)):] once it grows and does not end in an
    incomplete character; the window then moves to the tokens just emitted.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, context: Sequence[int], skip_special_tokens: bool
    ) -> None:
        """Start with the last CONTEXT_TOKENS `context` ids (the prompt) as the window."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(context[-CONTEXT_TOKENS:])  # the window, then the tokens not yet emitted
        self._read = len(self._ids)  # ids before this index have had their text emitted
        self._window_text = self._decode(self._ids)

    def _decode(self, token_ids: list[int]) -> str:
        """Decode ids with this sample's skip_special_tokens."""
        text = self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
        assert isinstance(text, str)
        return text

    def step(self, token_ids: Sequence[int]) -> str:
        """Append tokens and return the text they complete."""
        chunks = []
        for token_id in token_ids:
            self._ids.append(token_id)
            text = self._decode(self._ids)
            if len(text) > len(self._window_text) and not text.endswith(_INCOMPLETE):
                chunks.append(text[len(self._window_text) :])
                del self._ids[: self._read]
                self._read = len(self._ids)
                self._window_text = self._decode(self._ids)
        return "".join(chunks)


def make_text_stream(
    tokenizer: PreTrainedTokenizerBase, prompt_token_ids: Sequence[int], skip_special_tokens: bool
) -> TextStream:
    """DecodeStream for fast (Rust-backed) tokenizers, offsets over `decode` for the others."""
    if isinstance(tokenizer, PreTrainedTokenizerFast):
        return FastTextStream(tokenizer.backend_tokenizer, prompt_token_ids, skip_special_tokens)
    return OffsetTextStream(tokenizer, prompt_token_ids, skip_special_tokens)
