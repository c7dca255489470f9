"""GrammarBitmask: the fill overlapped with the forward masks exactly as the serial per-matcher fill did, and a
grammar that fails to fill fails its own request, not the step (nor hangs it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import xgrammar as xgr
from pagoda.server.engine.requests import RequestState
from pagoda.server.llm import LLM
from pagoda.server.sampling_params import SamplingParams, StructuredOutputsParams
from pagoda.server.structured import GrammarBitmask
from pagoda.server.testing import make_tiny_model

# A character vocabulary: every JSON text below tokenizes one character per token.
VOCAB = [*'{}[]":, ', *"0123456789", *"abcxyz", "<eos>"]
EOS = VOCAB.index("<eos>")
SCHEMA = {
    "type": "object",
    "properties": {"ab": {"type": "array", "items": {"type": "integer"}}},
    "required": ["ab"],
}
TEXT = '{"ab": [12, 3]}'


def compiled(vocab: list[str] = VOCAB) -> xgr.CompiledGrammar:
    """The schema's grammar over `vocab`."""
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
    return xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))


def serial_mask(
    logits: torch.Tensor,  # [num_rows, vocab]
    matchers: list[xgr.GrammarMatcher | None],
) -> torch.Tensor:  # [num_rows, vocab]
    """What the engine did before the overlap: fill per matcher, then xgrammar's own apply."""
    out = logits.clone()
    bitmask = xgr.allocate_token_bitmask(len(matchers), len(VOCAB))
    rows = [i for i, m in enumerate(matchers) if m is not None]
    for i in rows:
        matcher = matchers[i]
        assert matcher is not None
        if matcher.is_terminated():
            bitmask[i].zero_()
            bitmask[i, EOS // 32] = 1 << (EOS % 32)
        else:
            matcher.fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(out, bitmask, vocab_size=len(VOCAB), indices=rows)
    return out


def test_overlapped_fill_gives_the_serial_masks() -> None:
    """Step after step (matchers at staggered states, one terminated, unconstrained rows between), the masks of
    start_fill + apply equal the serial fill's, and unconstrained rows are untouched."""
    grammar = compiled()
    tokens = [VOCAB.index(c) for c in TEXT] + [EOS]
    matchers = [xgr.GrammarMatcher(grammar) for _ in range(4)]
    positions = [0, 5, 10, len(tokens)]  # the last one accepted eos: terminated
    for matcher, position in zip(matchers, positions, strict=True):
        for token in tokens[:position]:
            assert matcher.accept_token(token)
    assert matchers[3].is_terminated()
    rows: list[xgr.GrammarMatcher | None] = [matchers[0], None, matchers[1], matchers[2], None, matchers[3]]
    bitmask = GrammarBitmask(len(VOCAB), [EOS])
    generator = torch.Generator().manual_seed(0)
    for step in range(len(tokens)):
        logits = torch.randn(len(rows), len(VOCAB), generator=generator)
        expected = serial_mask(logits, rows)
        pending = bitmask.start_fill(rows)
        assert pending is not None
        assert bitmask.apply(logits, pending) == ()
        assert torch.equal(logits, expected), step
        for i, matcher in enumerate(matchers):  # advance every live grammar by its next token of TEXT
            if not matcher.is_terminated():
                assert matcher.accept_token(tokens[positions[i]])
                positions[i] += 1
    assert bitmask.start_fill([None, None]) is None


def test_a_failing_fill_fails_only_its_row() -> None:
    """A matcher whose fill raises (its grammar's vocabulary is wider than the bitmask) is reported as failed;
    the other rows are masked as usual, and the future resolves (no hang)."""
    good = xgr.GrammarMatcher(compiled())
    bad = xgr.GrammarMatcher(compiled([*VOCAB[:-1], *(f"w{i}" for i in range(40)), "<eos>"]))
    rows: list[xgr.GrammarMatcher | None] = [good, None, bad]
    logits = torch.randn(3, len(VOCAB))
    expected = serial_mask(logits, [good, None, None])
    bitmask = GrammarBitmask(len(VOCAB), [EOS])
    pending = bitmask.start_fill(rows)
    assert pending is not None
    assert bitmask.apply(logits, pending.result(timeout=30)) == (2,)
    assert torch.equal(logits[:2], expected[:2])


@pytest.mark.timeout(300)
def test_engine_aborts_the_request_whose_grammar_fails(tmp_path: Path) -> None:
    """In the engine, a request whose grammar cannot fill ends as an abort; the others in its batch finish."""
    path = make_tiny_model("llama", tmp_path / "llama", max_position_embeddings=1024)
    llm = LLM(str(path), max_model_len=512, dtype="float32")
    engine = llm.engine
    constrained = SamplingParams(max_tokens=400, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    plain = SamplingParams(max_tokens=8, ignore_eos=True)
    tokenizer = engine.tokenizer
    for request_id, params in (("ok", constrained), ("broken", constrained), ("plain", plain)):
        engine.add_request(request_id, tokenizer.encode("a pet"), params)
    finished = {}
    while len(engine.gate):  # let both grammars compile and the requests be admitted
        # The plain request is not held: while a cold compile takes long, it may finish right here.
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    broken = engine.owners.requests["broken"]
    assert isinstance(broken, RequestState)
    (sample,) = broken.samples.values()
    sample.matcher = xgr.GrammarMatcher(compiled())  # a grammar over another vocabulary: its fill raises
    for _ in range(1000):
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        if not engine.has_unfinished_requests():
            break
    assert finished["broken"].outputs[0].finish_reason == "abort"
    assert finished["plain"].outputs[0].finish_reason == "length"
    assert len(finished["plain"].outputs[0].token_ids) == 8
    assert finished["ok"].outputs[0].finish_reason == "stop"
    assert isinstance(json.loads(finished["ok"].outputs[0].text)["ab"], list)
