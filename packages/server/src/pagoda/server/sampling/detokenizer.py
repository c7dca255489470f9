"""Per-sample incremental detokenization with stop strings (vLLM v1's semantics)."""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.server.sampling.streams import make_text_stream
from pagoda.server.sampling_params import SamplingParams
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast


def find_stop(text: str, new_start: int, stops: Sequence[str]) -> tuple[int, str] | None:
    """The stop string occurrence that uses text from `new_start` on and ends first (then starts first).

    Ending first is the match a token-by-token stream would see first, so the result does not depend on how
    the text was chunked. Each stop string is searched from new_start - len(stop) + 1 only: matches ending
    earlier were looked for when their text arrived.
    """
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for stop in stops:
        start = text.find(stop, max(0, new_start - len(stop) + 1))
        if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
            best = (start + len(stop), start, stop)
    return None if best is None else (best[1], best[2])


def stop_holdback(params: SamplingParams) -> int:
    """How many last characters an unfinished sample's text holds back: those a stop string may still use."""
    longest = max((len(stop) for stop in params.stop), default=0)
    return longest - 1 if longest and not params.include_stop_str_in_output else 0


class IncrementalDetokenizer:
    """Decodes one sample's tokens as they arrive and watches for its stop strings.

    The text ends before a matched stop string (or after it with include_stop_str_in_output). Until the sample
    finishes, `output_text` holds back the last max(len(stop)) - 1 characters, so that a streamed delta never
    shows the start of a stop string that the next tokens complete. Stop strings count only once more than
    min_tokens tokens were generated, as in vLLM.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
    ) -> None:
        """Start a sample of the given prompt; the prompt's last tokens give the first token its context."""
        self._tokenizer = tokenizer
        self._stream = make_text_stream(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self._stops = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._holdback = stop_holdback(params)
        self._text = ""
        self._num_tokens = 0
        self._matched: str | None = None

    @property
    def num_tokens(self) -> int:
        """How many generated tokens were added."""
        return self._num_tokens

    def add_tokens(self, new_token_ids: Sequence[int]) -> str | None:
        """Append generated tokens; return the stop string they complete, if any (the sample then ends)."""
        if self._matched is not None:
            raise RuntimeError(f"tokens added after the stop string {self._matched!r} ended the sample")
        new_start = len(self._text)
        self._text += self._stream.step(new_token_ids)
        self._num_tokens += len(new_token_ids)
        if not self._stops or self._num_tokens <= self._min_tokens:
            return None
        found = find_stop(self._text, new_start, self._stops)
        if found is None:
            return None
        position, stop = found
        self._text = self._text[: position + len(stop) if self._include_stop else position]
        self._matched = stop
        return stop

    def output_text(self, finished: bool) -> str:
        """The text so far; unless finished or stopped, without the characters a stop string may still use."""
        if finished or self._matched is not None or not self._holdback:
            return self._text
        return self._text[: max(0, len(self._text) - self._holdback)]

    def decode_token(self, token_id: int) -> str:
        """The text of one token on its own, for logprob entries (a lone byte token may decode to U+FFFD)."""
        if isinstance(self._tokenizer, PreTrainedTokenizerFast):
            return self._tokenizer.backend_tokenizer.decode([token_id], skip_special_tokens=False)
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        assert isinstance(text, str)
        return text
