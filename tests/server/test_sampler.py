"""Sampler: greedy and truncation identities, penalties against a per-row reference, seeds, logprobs, bad rows."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch
from pagoda.pagedkernel.sampling import SampleStatus
from pagoda.server.sampling import Sampler, SamplingRow, unseeded_seed
from pagoda.server.sampling.penalties import apply_history
from pagoda.server.sampling.sampler import op_backend_name
from pagoda.server.sampling_params import SamplingParams
from torch import Tensor

VOCAB = 48


def row(
    params: SamplingParams,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    seed: int | None = None,
    stop_token_ids: tuple[int, ...] = (),
    sample_index: int = 0,
) -> SamplingRow:
    """A sampling row with keyword defaults (seed: the request's, else a fixed unseeded one)."""
    if seed is None:
        seed = params.seed if params.seed is not None else unseeded_seed(0, 1)
    return SamplingRow(params, prompt, output, seed, sample_index, stop_token_ids)


def unseeded_rows(params: SamplingParams, count: int) -> list[SamplingRow]:
    """`count` rows of distinct unseeded requests (as the engine numbers them), at output position 0."""
    return [row(params, seed=unseeded_seed(0, i + 1)) for i in range(count)]


def random_logits(num_rows: int, seed: int, vocab: int = VOCAB, scale: float = 3.0) -> Tensor:
    """Reproducible [num_rows, vocab] float32 logits."""
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def frequencies(tokens: list[int], vocab: int) -> Tensor:
    """Empirical distribution of sampled tokens."""
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
    return counts / counts.sum()


def test_greedy_is_exact_argmax_whatever_the_seed() -> None:
    """Temperature 0 is argmax whatever the truncation settings, the seed and the sample index."""
    logits = random_logits(6, 0)
    params = SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2, seed=7)
    out = Sampler()(logits, [row(params, seed=7 + i, sample_index=i) for i in range(6)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 6
    assert out.failed == {}


def test_greedy_ties_pick_the_lowest_token_id() -> None:
    """Equal maxima resolve to the first one, as argmax (and transformers' greedy search) does, over a full vocab."""
    logits = torch.zeros(3, 262_144)
    logits[0, [7, 200_000]] = 5.0
    logits[1, [131_072, 131_073, 262_143]] = 1.0
    logits[2, :] = -1.0
    out = Sampler()(logits, [row(SamplingParams(temperature=0.0))] * 3)
    assert out.token_ids == [7, 131_072, 0] == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("vocab", [7, 4096, 4096 + 5, 262_144, 151_936])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_greedy_equals_argmax_with_ties_and_nan(vocab: int, dtype: torch.dtype, backend: str) -> None:
    """Greedy rows equal torch.argmax on random rows and ties (the first wins); NaN rows fail, alone."""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(8, vocab, generator=generator).to(dtype)
    logits[1, [vocab // 2, vocab - 1]] = 50.0  # a tie: the earlier one wins
    logits[2, [0, vocab - 1]] = 50.0
    logits[3, vocab - 1] = 60.0  # the maximum in the last logit (the tail when vocab is not a chunk multiple)
    logits[4, [vocab // 3, vocab - 2]] = float("nan")  # NaN is the maximum, the first NaN wins
    logits[5, vocab - 1] = float("nan")
    logits[6, :] = 1.0
    out = Sampler(backend)(logits, [row(SamplingParams(temperature=0.0))] * 8)
    assert out.failed == {4: SampleStatus.NONFINITE, 5: SampleStatus.NONFINITE}
    expected = logits.argmax(dim=-1).tolist()
    assert [t for i, t in enumerate(out.token_ids) if i not in (4, 5)] == expected[:4] + expected[6:]


def test_bfloat16_logits_sample_like_their_float32_copy() -> None:
    """Model-dtype logits: the plain greedy batch argmaxes them as they are; logprobs come out in float32."""
    logits = random_logits(4, 3).bfloat16()
    plain = Sampler()(logits, [row(SamplingParams(temperature=0.0))] * 4)
    assert plain.token_ids == logits.float().argmax(dim=-1).tolist()
    with_logprobs = Sampler()(logits, [row(SamplingParams(temperature=0.0, logprobs=2))] * 4)
    assert with_logprobs.token_ids == plain.token_ids
    expected = torch.log_softmax(logits.float(), dim=-1)
    for i, entry in enumerate(with_logprobs.logprobs):
        assert entry is not None
        assert entry.logprob == pytest.approx(float(expected[i, plain.token_ids[i]]), abs=1e-6)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.3, top_k=1),
        SamplingParams(temperature=0.7, top_p=1e-6),
        SamplingParams(temperature=2.0, top_k=5, top_p=1e-6),
        SamplingParams(temperature=1.0, min_p=1.0),
    ],
    ids=["top_k=1", "tiny top_p", "top_k+tiny top_p", "min_p=1"],
)
def test_degenerate_truncation_equals_greedy(params: SamplingParams) -> None:
    """Settings that keep only the most likely token reproduce greedy, seeded or not."""
    logits = random_logits(32, 1)
    original = logits.clone()
    rows = [row(params, seed=i if i % 2 else None) for i in range(32)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(dim=-1).tolist()
    assert torch.equal(logits, original), "the caller's logits are never edited"


def test_distribution_matches_softmax_with_temperature() -> None:
    """Unseeded rows (one per request) and a seeded row drawn step after step both follow softmax(l / T)."""
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 2.0, -3.0, 0.2]])
    temperature = 0.7
    expected = torch.softmax(logits[0].double() / temperature, dim=0)
    params = SamplingParams(temperature=temperature)
    many = Sampler()(logits.expand(6000, -1), unseeded_rows(params, 6000)).token_ids
    assert (frequencies(many, 8) - expected).abs().max() < 0.03
    seeded = SamplingParams(temperature=temperature, seed=99)
    sampler = Sampler()
    steps = [sampler(logits, [row(seeded, output=[0] * i)]).token_ids[0] for i in range(3000)]
    assert (frequencies(steps, 8) - expected).abs().max() < 0.04


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        # Logits [4, 3, 2, 1, 0, ...]: min_p 0.3 keeps p >= 0.3 p_max, i.e. logits >= 4 + ln 0.3 = 2.8.
        (SamplingParams(min_p=0.3), [0, 1]),
        (SamplingParams(top_k=3), [0, 1, 2]),
        # top_p 0.9: tokens 0 (0.64), 1 (0.24) hold 0.88 < 0.9, so token 2 is needed too.
        (SamplingParams(top_p=0.9), [0, 1, 2]),
        (SamplingParams(top_k=2, top_p=0.99), [0, 1]),
    ],
    ids=["min_p", "top_k", "top_p", "top_k+top_p"],
)
def test_truncation_keeps_exactly_the_allowed_set_renormalized(
    params: SamplingParams, allowed: list[int]
) -> None:
    """Only allowed tokens are drawn, each with its renormalized probability."""
    vocab = 8
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0]])
    tokens = Sampler()(logits.expand(5000, -1), unseeded_rows(params, 5000)).token_ids
    assert set(tokens) == set(allowed)
    probs = torch.softmax(logits[0, allowed].double(), dim=0)
    assert (frequencies(tokens, vocab)[allowed] - probs).abs().max() < 0.03


def reference_history(logits: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
    """A straightforward per-row, per-token implementation of penalties and min_tokens masking."""
    out = logits.tolist()
    for values, r in zip(out, rows, strict=True):
        p = r.params
        for token in set(r.prompt_token_ids) | set(r.output_token_ids):
            value = values[token]
            values[token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        for token in set(r.output_token_ids):
            count = list(r.output_token_ids).count(token)
            values[token] -= p.frequency_penalty * count + p.presence_penalty
        if len(r.output_token_ids) < p.min_tokens:
            for token in r.stop_token_ids:
                values[token] = -math.inf
    return torch.tensor(out)


def random_history_rows(num_rows: int, seed: int, temperature: float = 0.0) -> list[SamplingRow]:
    """Rows with random histories, penalties (often neutral) and min_tokens."""
    g = torch.Generator().manual_seed(seed)

    def pick(options: Sequence[float]) -> float:
        return options[int(torch.randint(len(options), (1,), generator=g))]

    rows = []
    for _ in range(num_rows):
        prompt = torch.randint(VOCAB, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g).tolist()
        output = torch.randint(VOCAB, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g).tolist()
        params = SamplingParams(
            temperature=temperature,
            repetition_penalty=pick([1.0, 1.3, 0.7, 2.0]),
            frequency_penalty=pick([0.0, 0.5, -1.0]),
            presence_penalty=pick([0.0, 1.5, -0.5]),
            min_tokens=int(pick([0, 3, 10])),
            max_tokens=16,
        )
        stop = tuple(torch.randint(VOCAB, (2,), generator=g).tolist())
        rows.append(row(params, prompt, output, stop_token_ids=stop))
    return rows


def test_penalties_and_min_tokens_match_the_reference() -> None:
    """The vectorized history stage equals the per-row reference to float precision."""
    rows = random_history_rows(64, 2)
    logits = random_logits(64, 3)
    edited = apply_history(logits, rows)
    expected = reference_history(logits, rows)
    assert torch.equal(torch.isinf(edited), torch.isinf(expected))
    finite = torch.isfinite(expected)
    torch.testing.assert_close(edited[finite], expected[finite], rtol=1e-6, atol=1e-6)
    assert not torch.equal(edited, logits), "the random rows must exercise at least one penalty"


def test_greedy_sampling_applies_penalties() -> None:
    """Greedy rows take the argmax of the penalized logits (vLLM order: penalties, then sampling)."""
    rows = random_history_rows(64, 4)
    logits = random_logits(64, 5, scale=0.5)  # small logits so that penalties often change the argmax
    expected = reference_history(logits, rows).argmax(dim=-1)
    assert Sampler()(logits, rows).token_ids == expected.tolist()
    assert not torch.equal(expected, logits.argmax(dim=-1))


def test_history_stage_is_skipped_when_no_row_needs_it() -> None:
    """Neutral penalties and met min_tokens leave the logits tensor itself untouched (no copy)."""
    logits = random_logits(3, 6)
    rows = [
        row(SamplingParams(), [1, 2], [3]),
        row(SamplingParams(min_tokens=1, frequency_penalty=0.5), [1], [], stop_token_ids=()),
        row(SamplingParams(min_tokens=2), [], [4, 5], stop_token_ids=(0,)),
    ]
    # Row 1 has a frequency penalty but no output yet, and no stop ids to mask.
    assert apply_history(logits, rows) is logits


def test_min_tokens_blocks_stop_ids_until_reached() -> None:
    """While fewer than min_tokens are generated the stop ids cannot be drawn; afterwards they can."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 50.0  # eos-like token that would win every draw
    logits[0, 9] = 49.0
    params = SamplingParams(min_tokens=3, temperature=1.0)
    sampler = Sampler()
    for generated in range(3):
        out = sampler(logits, [row(params, output=[1] * generated, stop_token_ids=(7,))])
        assert out.token_ids == [9]
    blocked_greedy = row(SamplingParams(temperature=0.0, min_tokens=3), output=[1], stop_token_ids=(7, 9))
    assert sampler(logits, [blocked_greedy]).token_ids[0] not in (7, 9)
    assert sampler(logits, [row(params, output=[1, 1, 1], stop_token_ids=(7,))]).token_ids == [7]


def seeded_steps(
    params: SamplingParams,
    logits: Tensor,
    position: int,
    others: Sequence[SamplingRow],
    steps: int,
    backend: str = "cpu",
) -> list[int]:
    """Tokens a fresh seeded row draws over several steps when placed at `position` among `others` (whose
    unseeded rows take new seeds every step)."""
    sampler = Sampler(backend)
    tokens = []
    for step in range(steps):
        neighbours = [o if o.params.seed is not None else replace(o, seed=o.seed + step) for o in others]
        rows = [*neighbours[:position], row(params, output=[0] * step), *neighbours[position:]]
        batch = torch.cat([logits[:position], logits[-1:], logits[position : len(others)]])
        tokens.append(sampler(batch, rows).token_ids[position])
    return tokens


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.9, seed=42),
        SamplingParams(temperature=1.2, top_k=5, seed=42),
        SamplingParams(temperature=0.8, min_p=0.05, seed=42),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=42),
    ],
    ids=["plain", "top_k", "min_p", "top_p"],
)
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_same_seed_same_tokens_whatever_the_batch(params: SamplingParams, backend: str) -> None:
    """A seeded row draws the same tokens alone and at any position among greedy, seeded, unseeded and
    top_p, top_k, min_p and penalized rows, and the same on the cpu and torch backends."""
    logits = random_logits(6, 7, scale=1.0)
    others = [
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=1.0, top_p=0.8)),
        row(SamplingParams(temperature=0.5, seed=3)),
        row(SamplingParams(temperature=1.5, top_k=3, min_p=0.1)),
        row(SamplingParams(temperature=1.0, repetition_penalty=1.5), prompt=[1, 2, 3]),
    ]
    alone = seeded_steps(params, logits, 0, [], 20)
    assert len(set(alone)) > 1, "the seeded row must actually sample"
    for position in (0, 2, 5):
        assert seeded_steps(params, logits, position, others, 20, backend) == alone


def test_samples_of_one_seed_differ_and_neighbouring_seeds_share_nothing() -> None:
    """Keys hash (seed, sample index, position): one seed repeats its tokens, its n samples differ, and seed
    s + 1's sample 0 no longer repeats seed s's sample 1 (the old seed + index rule made them equal)."""
    params = SamplingParams(temperature=1.0, seed=11, n=2)
    logits = random_logits(1, 8, scale=0.5)
    sampler = Sampler()

    def draws(seed: int, index: int) -> list[int]:
        rows = [row(params, output=[0] * step, seed=seed, sample_index=index) for step in range(40)]
        return sampler(logits.expand(40, -1), rows).token_ids

    assert draws(11, 0) == draws(11, 0)
    assert draws(11, 0) != draws(11, 1)
    assert draws(11, 1) != draws(12, 0)
    assert unseeded_seed(0, 1) != unseeded_seed(0, 2) != unseeded_seed(1, 2)


def test_logprobs_are_log_softmax_of_raw_logits_with_rank_and_top_k() -> None:
    """Logprobs ignore temperature and penalties; rank is 1-based; top-k lists have k entries."""
    logits = random_logits(5, 9)
    rows = [
        row(SamplingParams(temperature=0.8, logprobs=3, repetition_penalty=1.7), prompt=[1, 2, 3]),
        row(SamplingParams(temperature=0.0, logprobs=0)),
        row(SamplingParams(temperature=1.0)),
        row(SamplingParams(temperature=2.0, logprobs=20, presence_penalty=2.0), output=[4, 4]),
        row(SamplingParams(temperature=0.0, logprobs=5, min_tokens=2), stop_token_ids=(0, 1, 2, 3, 4, 5)),
    ]
    logits[4, :6] += 100.0  # the min_tokens row must sample a token that is not the raw argmax
    out = Sampler()(logits, rows)
    reference = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[2] is None
    for i, k in [(0, 3), (1, 0), (3, 20), (4, 5)]:
        entry = out.logprobs[i]
        assert entry is not None
        token = out.token_ids[i]
        assert abs(entry.logprob - float(reference[i, token])) < 1e-6
        assert entry.rank == 1 + int((reference[i] > reference[i, token]).sum())
        top = reference[i].topk(k)
        assert entry.top_token_ids == top.indices.tolist()
        assert len(entry.top_logprobs) == k
        assert (
            max((abs(a - b) for a, b in zip(entry.top_logprobs, top.values.tolist(), strict=True)), default=0)
            < 1e-6
        )
    assert out.logprobs[1] is not None and out.logprobs[1].rank == 1
    only_sampled = Sampler()(logits[:2], [row(SamplingParams(temperature=0.0, logprobs=0))] * 2).logprobs
    assert [(e.rank, e.top_token_ids) for e in only_sampled if e is not None] == [(1, []), (1, [])]
    assert out.logprobs[4] is not None and out.logprobs[4].rank > 6


def test_mixed_batch() -> None:
    """Every feature at once: each row's token equals what it gets in a batch of its own."""
    logits = random_logits(8, 10, scale=1.0)
    specs = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, seed=1, top_k=4),
        SamplingParams(temperature=1.1, seed=2, top_p=0.7, logprobs=2),
        SamplingParams(temperature=0.9, seed=3, min_p=0.2, repetition_penalty=1.4),
        SamplingParams(temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5, logprobs=1),
        SamplingParams(temperature=1.0, seed=4, top_k=10, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=0.6, seed=5, min_tokens=4),
        SamplingParams(temperature=0.0, top_k=2),
    ]

    def rows_for(indices: Sequence[int]) -> list[SamplingRow]:
        return [row(specs[i], [i, i + 1], [i + 2] * 3, stop_token_ids=(i,)) for i in indices]

    original = logits.clone()
    batch = Sampler()(logits, rows_for(range(8)))
    assert torch.equal(logits, original), "the caller's logits are never edited"
    for i in range(8):
        single = Sampler()(logits[i : i + 1], rows_for([i]))
        assert batch.token_ids[i] == single.token_ids[0]
        assert batch.logprobs[i] == single.logprobs[0]
    assert [entry is not None for entry in batch.logprobs] == [s.logprobs is not None for s in specs]


def test_a_nonfinite_or_fully_masked_row_fails_alone() -> None:
    """A NaN or +inf row, or one whose every logit is -inf, is reported in `failed`; the others sample."""
    logits = random_logits(5, 12)
    logits[1, 3] = float("nan")
    logits[2, 0] = float("inf")
    logits[3, :] = float("-inf")
    rows = [row(SamplingParams(temperature=t, seed=i)) for i, t in enumerate([0.0, 1.0, 0.0, 0.7, 0.9])]
    out = Sampler()(logits, rows)
    assert out.failed == {1: SampleStatus.NONFINITE, 2: SampleStatus.NONFINITE, 3: SampleStatus.NO_TOKEN}
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.token_ids[4] == Sampler()(logits[4:], rows[4:]).token_ids[0]


def test_engine_backend_names_map_to_sampling_backends() -> None:
    """cpu -> the C sampler, triton and cupy -> Triton, torch -> torch; an unknown name is refused."""
    assert [op_backend_name(n) for n in ("auto", "torch", "cpu", "triton", "cupy")] == [
        "auto",
        "torch",
        "cpu",
        "triton",
        "triton",
    ]
    assert Sampler("torch").op.name == "torch"
    assert Sampler("cpu").op.name == "cpu"
    with pytest.raises(ValueError, match="unknown kernel backend"):
        op_backend_name("numpy")


def test_rejects_mismatched_rows_and_out_of_vocab_history() -> None:
    """Shape mismatches and history ids outside the vocabulary raise instead of indexing wrongly."""
    with pytest.raises(ValueError, match="do not match"):
        Sampler()(random_logits(2, 0), [row(SamplingParams())])
    with pytest.raises(ValueError, match="token ids"):
        Sampler()(random_logits(1, 0), [row(SamplingParams(repetition_penalty=1.2), prompt=[VOCAB])])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_the_contract() -> None:
    """On CUDA: greedy is argmax, logprobs are exact, and a seeded row is batch-independent."""
    device = torch.device("cuda")
    logits = random_logits(4, 11).to(device)
    params = SamplingParams(temperature=0.9, seed=5, top_p=0.95, logprobs=2, repetition_penalty=1.2)
    others = [row(SamplingParams(temperature=0.0, logprobs=0)), row(SamplingParams(temperature=1.0, top_k=4))]

    def draw(batch_rows: list[SamplingRow], position: int, batch_logits: Tensor) -> list[int]:
        tokens = []
        for step in range(10):
            batch = [*batch_rows[:position], row(params, [1, 2], [0] * step), *batch_rows[position:]]
            tokens.append(Sampler("auto", device)(batch_logits, batch).token_ids[position])
        return tokens

    alone = draw([], 0, logits[3:4])
    mixed = torch.cat([logits[:1], logits[3:4], logits[1:2]])
    assert draw(others, 1, mixed) == alone
    out = Sampler("auto", device)(logits[:2], others)
    assert out.token_ids[0] == int(logits[0].argmax())
    entry = out.logprobs[0]
    assert entry is not None and entry.rank == 1
    assert abs(entry.logprob - float(torch.log_softmax(logits[0], dim=-1).max())) < 1e-5
