"""IncrementalDetokenizer: incremental text equals a full decode, stop strings, hold-back, special tokens."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagoda.server.sampling import IncrementalDetokenizer
from pagoda.server.sampling.detokenizer import find_stop
from pagoda.server.sampling.streams import FastTextStream, OffsetTextStream, TextStream, make_text_stream
from pagoda.server.sampling_params import SamplingParams
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers.decoders import DecodeStream
from transformers import ByT5Tokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

CORPUS = [
    "héllo 世界 🙂 hello world",
    "the quick brown fox jumps over the lazy dog",
    "naïve café déjà vu, 日本語のテキスト 🙂🙃",
    "stop STOP stopping at the end.",
] * 4
PROMPTS = ["", "hello", "héllo 世界", "the lazy dog 🙂", "naïve café"]
FAST_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE trained on the corpus (every byte is a token: any id sequence decodes)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=360,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers types its kwargs loosely
        tokenizer_object=tok, eos_token="<eos>", clean_up_tokenization_spaces=False
    )


@pytest.fixture(scope="module")
def sentencepiece() -> PreTrainedTokenizerFast:
    """A Llama-style BPE: "▁" for spaces, byte-fallback tokens <0x00>..<0xFF>, leading space stripped."""
    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], limit_alphabet=40, show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers types its kwargs loosely
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        bos_token="<s>",
        eos_token="</s>",
        clean_up_tokenization_spaces=False,
    )


@pytest.fixture(scope="module")
def byt5() -> ByT5Tokenizer:
    """A pure-Python tokenizer (one token per byte): the offset-based fallback path."""
    return ByT5Tokenizer()


def decode(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], skip: bool = True) -> str:
    """tokenizer.decode typed as str."""
    text = tokenizer.decode(list(ids), skip_special_tokens=skip)
    assert isinstance(text, str)
    return text


def check_stream_against_decode(
    tokenizer: PreTrainedTokenizerBase,
    prompt: str,
    output_ids: list[int],
    chunk: int,
    skip: bool,
    make: type[FastTextStream] | type[OffsetTextStream] | None = None,
) -> None:
    """After every chunk the incremental text is the full decode, except a trailing incomplete character.

    The expected text is decode(prompt + output) minus decode(prompt), which for byte-level BPE equals
    decode(output) and for sentencepiece keeps the first token's leading space. While the decode ends in an
    incomplete character (byte fallback even turns a whole byte run into U+FFFD then), the text so far must
    be a prefix of the final text.
    """
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    prompt_text = decode(tokenizer, prompt_ids, skip)
    params = SamplingParams(skip_special_tokens=skip)
    stream: TextStream | None = None
    if make is FastTextStream:
        assert isinstance(tokenizer, PreTrainedTokenizerFast)
        stream = FastTextStream(tokenizer.backend_tokenizer, prompt_ids, skip)
    elif make is OffsetTextStream:
        stream = OffsetTextStream(tokenizer, prompt_ids, skip)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    final = decode(tokenizer, [*prompt_ids, *output_ids], skip)[len(prompt_text) :]
    assert not final.endswith("\ufffd"), "the output must end with a complete character"
    text = ""
    for end in range(chunk, len(output_ids) + chunk, chunk):
        new = output_ids[end - chunk : end]
        if stream is None:
            assert detokenizer.add_tokens(new) is None
            text = detokenizer.output_text(finished=False)
        else:
            text += stream.step(new)
        full = decode(tokenizer, [*prompt_ids, *output_ids[:end]], skip)
        assert full.startswith(prompt_text)
        expected = full[len(prompt_text) :]
        assert final.startswith(text)
        if not expected.endswith("\ufffd"):
            assert text == expected
    assert text == final


def realistic_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids a model could produce for `text`, plus a final period so that every character completes."""
    return list(tokenizer.encode(text + ".", add_special_tokens=False))


TEXT = st.text(alphabet=st.sampled_from(list("ab cé世界🙂🙃\nxyz日本")), max_size=30)


@FAST_SETTINGS
@given(prompt=st.sampled_from(PROMPTS), data=st.data(), chunk=st.integers(1, 3), skip=st.booleans())
def test_byte_level_random_ids_decode_like_the_full_text(
    byte_level: PreTrainedTokenizerFast, prompt: str, data: st.DataObject, chunk: int, skip: bool
) -> None:
    """Arbitrary id sequences (split characters, lone continuation bytes, <eos>) through every path."""
    vocab = byte_level.backend_tokenizer.get_vocab_size()
    ids = data.draw(st.lists(st.integers(0, vocab - 1), max_size=24)) + byte_level.encode(".")
    for make in (None, FastTextStream, OffsetTextStream):
        check_stream_against_decode(byte_level, prompt, ids, chunk, skip, make)


@FAST_SETTINGS
@given(prompt=st.sampled_from(PROMPTS), text=TEXT, chunk=st.integers(1, 3))
def test_sentencepiece_text_decodes_with_its_spaces(
    sentencepiece: PreTrainedTokenizerFast, prompt: str, text: str, chunk: int
) -> None:
    """Byte-fallback characters and "▁" spaces; the first generated token keeps its leading space."""
    ids = realistic_ids(sentencepiece, text)
    for make in (None, FastTextStream, OffsetTextStream):
        check_stream_against_decode(sentencepiece, prompt, ids, chunk, True, make)


@FAST_SETTINGS
@given(prompt=st.sampled_from(PROMPTS), data=st.data(), chunk=st.integers(1, 3))
def test_pure_python_tokenizer_uses_offsets(
    byt5: ByT5Tokenizer, prompt: str, data: st.DataObject, chunk: int
) -> None:
    """A tokenizer without a Rust backend decodes through the offset stream, one byte per token."""
    assert isinstance(make_text_stream(byt5, [], True), OffsetTextStream)
    ids = data.draw(st.lists(st.integers(3, 258), max_size=24)) + byt5.encode(".", add_special_tokens=False)
    check_stream_against_decode(byt5, prompt, ids, chunk, True)


def test_first_token_keeps_its_space_after_a_prompt(sentencepiece: PreTrainedTokenizerFast) -> None:
    """Sentencepiece strips the leading space of a decode; a sample of a prompt must not lose it."""
    # A word token with its space marker, e.g. "▁the".
    word = min(t for t in sentencepiece.get_vocab() if t.startswith("▁") and t[1:].isalpha())
    word_id = sentencepiece.convert_tokens_to_ids(word)
    assert isinstance(word_id, int)
    params = SamplingParams()
    after_prompt = IncrementalDetokenizer(sentencepiece, sentencepiece.encode("hello"), params)
    after_prompt.add_tokens([word_id])
    assert after_prompt.output_text(finished=True) == " " + word[1:]
    no_prompt = IncrementalDetokenizer(sentencepiece, [], params)
    no_prompt.add_tokens([word_id])
    assert no_prompt.output_text(finished=True) == word[1:] == decode(sentencepiece, [word_id])


def test_decode_stream_restarts_after_an_invalid_byte_run(sentencepiece: PreTrainedTokenizerFast) -> None:
    """Byte 0x41 shows "A"; 0xFF makes the run [41 FF] decode to two U+FFFD, so DecodeStream raises at the
    next token. The stream shows the new tokens' own text, goes on, and also primes across such a run."""
    ids = sentencepiece.convert_tokens_to_ids(["<0x41>", "<0xFF>", "e"])
    assert isinstance(ids, list) and None not in ids
    a_byte, ff_byte, letter = ids
    backend = sentencepiece.backend_tokenizer
    raw = DecodeStream(skip_special_tokens=True)
    assert [raw.step(backend, a_byte), raw.step(backend, ff_byte)] == ["A", None]
    with pytest.raises(Exception, match="Invalid prefix"):
        raw.step(backend, letter)
    prompt = sentencepiece.encode("hello", add_special_tokens=False)
    stream = FastTextStream(backend, prompt, True)
    assert [stream.step([i]) for i in (a_byte, ff_byte, letter)] == ["A", "", "\ufffde"]
    tail = realistic_ids(sentencepiece, " the lazy dog")
    assert stream.step(tail) == decode(sentencepiece, [letter, *tail])[1:]
    # A prompt holding the same run: priming skips what it cannot decode, and the sample still decodes.
    primed = FastTextStream(backend, [*prompt, a_byte, ff_byte, letter], True)
    assert primed.step(tail) == decode(sentencepiece, [letter, *tail])[1:]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 400), min_size=1, max_size=30), skip=st.booleans())
def test_garbage_never_breaks_the_stream(
    sentencepiece: PreTrainedTokenizerFast, ids: list[int], skip: bool
) -> None:
    """Random ids (many invalid byte runs) never raise, and valid text afterwards decodes as usual.

    No incremental decoder can match decode() on such input (a later byte rewrites shown ones), so the
    check is that the stream recovers."""
    vocab = sentencepiece.backend_tokenizer.get_vocab_size()
    prompt = sentencepiece.encode("hello", add_special_tokens=False)
    stream = FastTextStream(sentencepiece.backend_tokenizer, prompt, skip)
    stream.step([i % vocab for i in ids])
    tail = realistic_ids(sentencepiece, " the quick brown fox")
    assert stream.step(tail).endswith(decode(sentencepiece, tail))


def feed(detokenizer: IncrementalDetokenizer, ids: Sequence[int]) -> tuple[str | None, list[str], int]:
    """Add ids one at a time until a stop string: (stop, streamed texts, number of ids added)."""
    streamed = []
    for count, token_id in enumerate(ids, start=1):
        stop = detokenizer.add_tokens([token_id])
        streamed.append(detokenizer.output_text(finished=stop is not None))
        if stop is not None:
            return stop, streamed, count
    return None, streamed, len(ids)


def char_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """One or more tokens per character, so that stop strings span token boundaries."""
    return [i for char in text for i in tokenizer.encode(char, add_special_tokens=False)]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens(byte_level: PreTrainedTokenizerFast, include: bool) -> None:
    """The stop string is found across tokens and the text ends before it (or after it when included);
    streamed snapshots only ever grow and never show a part of the stop string that later matched."""
    ids = char_ids(byte_level, "say héllo 世界 STOP now")
    detokenizer = IncrementalDetokenizer(
        byte_level, [], SamplingParams(stop=("STOP", "xyz"), include_stop_str_in_output=include)
    )
    stop, streamed, added = feed(detokenizer, ids)
    assert stop == "STOP"
    assert added == len(char_ids(byte_level, "say héllo 世界 STOP"))
    final = "say héllo 世界 STOP" if include else "say héllo 世界 "
    assert streamed[-1] == final == detokenizer.output_text(finished=False)
    for before, after in itertools.pairwise(streamed):
        assert after.startswith(before)
    with pytest.raises(RuntimeError, match="STOP"):
        detokenizer.add_tokens(ids[added:])


def byte_ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """One byte-level token per UTF-8 byte of `text` (the 256 single-byte tokens are always in the vocab)."""
    mapped = "".join(
        piece for piece, _ in pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(text)
    )
    ids = tokenizer.convert_tokens_to_ids(list(mapped))
    assert isinstance(ids, list) and len(ids) == len(text.encode())
    return ids


def test_multibyte_stop_string_split_over_byte_tokens(byte_level: PreTrainedTokenizerFast) -> None:
    """A stop string starting with a character whose three bytes arrive as three tokens; one character of
    hold-back (len("世a") - 1) keeps " " then "世" out of the stream until they are known not to stop."""
    detokenizer = IncrementalDetokenizer(byte_level, [], SamplingParams(stop=("世a",)))
    stop, streamed, added = feed(detokenizer, byte_ids(byte_level, "ab 世ab"))
    assert stop == "世a"
    assert added == 7
    assert streamed == ["", "a", "ab", "ab", "ab", "ab ", "ab "]


def test_holdback_and_finish(byte_level: PreTrainedTokenizerFast) -> None:
    """Unfinished text holds back max(len(stop)) - 1 characters; a finished sample shows everything."""
    detokenizer = IncrementalDetokenizer(byte_level, [], SamplingParams(stop=("abcd", "z")))
    assert detokenizer.add_tokens(char_ids(byte_level, "hello ab")) is None
    assert detokenizer.output_text(finished=False) == "hello"
    assert detokenizer.output_text(finished=True) == "hello ab"
    assert detokenizer.num_tokens == len(char_ids(byte_level, "hello ab"))
    short = IncrementalDetokenizer(byte_level, [], SamplingParams(stop=("abcd",)))
    short.add_tokens(char_ids(byte_level, "a"))
    assert short.output_text(finished=False) == ""
    included = IncrementalDetokenizer(
        byte_level, [], SamplingParams(stop=("abcd",), include_stop_str_in_output=True)
    )
    included.add_tokens(char_ids(byte_level, "xab"))
    assert included.output_text(finished=False) == "xab"  # nothing to retract: a match keeps the stop string


def test_whole_chunk_stop_truncates_inside_it(byte_level: PreTrainedTokenizerFast) -> None:
    """Several tokens added at once: the text ends before the first completed match, text after it is gone."""
    detokenizer = IncrementalDetokenizer(byte_level, [], SamplingParams(stop=("bcd", "abcdef")))
    assert detokenizer.add_tokens(byte_level.encode("xxabcdefyy", add_special_tokens=False)) == "bcd"
    assert detokenizer.output_text(finished=False) == "xxa"


def test_stop_strings_wait_for_min_tokens(byte_level: PreTrainedTokenizerFast) -> None:
    """As in vLLM, a stop string counts only once more than min_tokens tokens exist."""
    ids = char_ids(byte_level, "ab ab ab")
    detokenizer = IncrementalDetokenizer(
        byte_level, [], SamplingParams(stop=("ab",), min_tokens=3, max_tokens=20)
    )
    stop, streamed, added = feed(detokenizer, ids)
    assert stop == "ab"
    assert added == 5  # "ab" at tokens 1-2 is too early; " ab" completes at token 5
    assert streamed[-1] == "ab "


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.text(alphabet=st.sampled_from(list("ab 世🙂")), max_size=20),
    stops=st.lists(
        st.text(alphabet=st.sampled_from(list("ab 世🙂")), min_size=1, max_size=4), min_size=1, max_size=3
    ),
    include=st.booleans(),
    chunk=st.integers(1, 4),
)
def test_stop_strings_against_a_reference(
    byte_level: PreTrainedTokenizerFast, text: str, stops: list[str], include: bool, chunk: int
) -> None:
    """Final text = text up to the first-ending match; streamed snapshots are prefixes of it."""
    ids = char_ids(byte_level, text)
    matches = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if matches:
        end, start, stop = min(matches)
        expected, expected_stop = (text[:end] if include else text[:start]), stop
    else:
        expected, expected_stop = text, None
    detokenizer = IncrementalDetokenizer(
        byte_level, [], SamplingParams(stop=tuple(stops), include_stop_str_in_output=include)
    )
    found = None
    snapshots = []
    for begin in range(0, len(ids), chunk):
        found = detokenizer.add_tokens(ids[begin : begin + chunk])
        snapshots.append(detokenizer.output_text(finished=False))
        if found is not None:
            break
    assert found == expected_stop
    assert detokenizer.output_text(finished=True) == expected
    assert all(expected.startswith(s) for s in snapshots)


def test_find_stop_prefers_the_first_completed_match() -> None:
    """Ends first wins; on a tie the longer (earlier starting) one; old text is not searched again."""
    assert find_stop("xxabcdef", 2, ["abcdef", "bcd"]) == (3, "bcd")
    assert find_stop("xxabcd", 2, ["bcd", "abcd"]) == (2, "abcd")
    assert find_stop("abcab", 4, ["abc"]) is None  # the first "abc" ended before new text started
    assert find_stop("abcab", 2, ["abc"]) == (0, "abc")


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(byte_level: PreTrainedTokenizerFast, skip: bool) -> None:
    """Special tokens vanish from the text with skip_special_tokens and appear verbatim without it."""
    eos = byte_level.eos_token_id
    assert isinstance(eos, int)
    ids = [*byte_level.encode("hi", add_special_tokens=False), eos, *byte_level.encode(" there")]
    detokenizer = IncrementalDetokenizer(byte_level, [eos], SamplingParams(skip_special_tokens=skip))
    detokenizer.add_tokens(ids)
    assert detokenizer.output_text(finished=True) == ("hi there" if skip else "hi<eos> there")


def test_decode_token(byte_level: PreTrainedTokenizerFast, byt5: ByT5Tokenizer) -> None:
    """One token's own text: words with their space, special tokens verbatim, a lone UTF-8 byte as U+FFFD."""
    detokenizer = IncrementalDetokenizer(byte_level, [], SamplingParams())
    assert detokenizer.decode_token(byte_level.encode(" world", add_special_tokens=False)[0]).startswith(" w")
    eos = byte_level.eos_token_id
    assert isinstance(eos, int)
    assert detokenizer.decode_token(eos) == "<eos>"
    assert detokenizer.decode_token(byte_ids(byte_level, "世")[0]) == "\ufffd"
    slow = IncrementalDetokenizer(byt5, [], SamplingParams())
    assert slow.decode_token(ord("a") + 3) == "a"
