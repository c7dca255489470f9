"""The LM head fused with the draw (`pagoda.pagedkernel.sampling.fused_head`): the tokens and statuses of the
unfused pair (the C GEMV's logits, then the torch sampling specification) bit for bit, on every GGUF format the
GEMV takes, 1-16 rows, vocabularies that are not a multiple of the chunk, ties across chunks, NaN / inf weights,
any thread count and every GEMV path (VNNI, AVX2, generic C); and draws that fit the exact softmax (chi-square)."""

from __future__ import annotations

import platform

import pytest
import torch
from pagoda.pagedkernel.quant.formats import GGMLType, QuantizedTensor
from pagoda.pagedkernel.quant.ops import qmatmul
from pagoda.pagedkernel.quant.testing import random_weight
from pagoda.pagedkernel.sampling import fused_head as fh
from pagoda.pagedkernel.sampling import rng_key, torch_sampling
from pagoda.pagedkernel.sampling.testing import exact_probabilities, sorted_kept_mask
from pagoda.pagedkernel.testing import c_kernel_or_skip
from torch import Tensor

QTYPES = sorted(fh.SUPPORTED_QTYPES)
HEAD_CHUNK = 128  # cpu_fused_head.c's chunk: vocabularies below are not multiples of it


@pytest.fixture(scope="module", autouse=True)
def _library() -> None:
    """Build the library first: a compile error fails every test here (only a missing compiler skips)."""
    c_kernel_or_skip(fh.kernels)


def reference(
    x: Tensor,  # [rows, K]
    weight: QuantizedTensor,  # [vocab, K]
    inv_t: Tensor,  # float32 [rows]
    keys: Tensor,  # int64 [rows]
    top_k: Tensor | None = None,  # int64 [rows]
    top_p: Tensor | None = None,  # float32 [rows]
) -> tuple[Tensor, Tensor]:  # int64 [rows], int32 [rows]
    """The unfused pair: the C GEMV's logits in x's dtype, then torch_sampling.run (no min_p)."""
    logits = qmatmul(x, weight, backend="cpu")
    rows = x.shape[0]
    ks = torch.zeros(rows, dtype=torch.int64) if top_k is None else top_k
    ps = torch.ones(rows) if top_p is None else top_p
    tokens, status, _ = torch_sampling.run(logits, inv_t, ks, ps, torch.zeros(rows), keys, with_mask=False)
    return tokens, status


def inputs(rows: int, k: int, dtype: torch.dtype, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """x [rows, K] (with a larger row scale, so that the Gumbel noise and the logits compete), greedy and sampled
    rows at temperatures 0.5-2, and row keys."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=g) * 8.0).to(dtype)
    inv_t = torch.tensor([[0.0, 1.0, 2.0, 0.5][r % 4] for r in range(rows)], dtype=torch.float32)
    keys = torch.tensor([rng_key(seed, r, 7) for r in range(rows)], dtype=torch.int64)
    return x, inv_t, keys


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 16])
def test_tokens_equal_the_unfused_pair(qtype: GGMLType, dtype: torch.dtype, rows: int) -> None:
    """Greedy and sampled rows (temperatures 0.5-2) of a 1,000-token head (7 full chunks and a tail of 104)."""
    vocab, k = 7 * HEAD_CHUNK + 104, 512
    weight = random_weight(qtype, (vocab, k), torch.Generator().manual_seed(rows))
    for seed in range(3):
        x, inv_t, keys = inputs(rows, k, dtype, seed)
        tokens, status = fh.fused_head(x, weight, inv_t, keys)
        want_tokens, want_status = reference(x, weight, inv_t, keys)
        assert status.tolist() == want_status.tolist() == [0] * rows
        assert tokens.tolist() == want_tokens.tolist()


@pytest.mark.parametrize("vocab", [1, 127, 129, 3 * HEAD_CHUNK - 1, 49_153])
def test_vocabularies_of_any_size(vocab: int) -> None:
    """One token to more than the parallel threshold, never a multiple of the chunk."""
    weight = random_weight(GGMLType.Q8_0, (vocab, 64), torch.Generator().manual_seed(vocab))
    x, inv_t, keys = inputs(4, 64, torch.float32, vocab)
    tokens, status = fh.fused_head(x, weight, inv_t, keys)
    assert (tokens.tolist(), status.tolist()) == tuple(t.tolist() for t in reference(x, weight, inv_t, keys))
    assert all(0 <= t < vocab for t in tokens.tolist())


def test_ties_across_chunks_take_the_lowest_index() -> None:
    """The greedy row's maximum copied into rows of earlier and later chunks: the lowest index wins, as torch's
    argmax; in bfloat16 logits many more values tie. The vocabulary is long enough that both threads take chunks
    (their bests are merged by the lowest index too)."""
    vocab, k = 400 * HEAD_CHUNK + 5, 256
    weight = random_weight(GGMLType.Q4_1, (vocab, k), torch.Generator().manual_seed(3))
    x, _, keys = inputs(2, k, torch.float32, 3)
    inv_t = torch.zeros(2)
    best = int(qmatmul(x[:1], weight, backend="cpu").argmax())
    rows = weight.data.view(vocab, -1)
    for at in (best + 3 * HEAD_CHUNK + 1, best + vocab // 2, best + vocab // 3, vocab - 1):
        rows[at % vocab] = rows[best]
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        tokens, status = fh.fused_head(xd, weight, inv_t, keys)
        want_tokens, want_status = reference(xd, weight, inv_t, keys)
        assert tokens.tolist() == want_tokens.tolist()
        assert status.tolist() == want_status.tolist()
    first = min(i for i in range(vocab) if torch.equal(rows[i], rows[best]))
    for _ in range(8):  # which thread takes which chunks varies from call to call
        assert int(fh.fused_head(x, weight, inv_t, keys)[0][0]) == first


def test_nonfinite_weights_give_the_unfused_statuses() -> None:
    """Every byte random (NaN, inf and subnormal float16 scales): NaN / +inf rows fail as NONFINITE, the others
    draw the unfused token."""
    vocab, k = 2 * HEAD_CHUNK + 31, 64
    for seed in range(4):
        weight = random_weight(GGMLType.Q8_0, (vocab, k), torch.Generator().manual_seed(seed), scale=0.0)
        x, inv_t, keys = inputs(4, k, torch.float32, seed)
        tokens, status = fh.fused_head(x, weight, inv_t, keys)
        want_tokens, want_status = reference(x, weight, inv_t, keys)
        assert status.tolist() == want_status.tolist()
        assert tokens.tolist() == want_tokens.tolist()


def test_tokens_do_not_depend_on_the_thread_count() -> None:
    """Each thread's bests are merged by (value, lowest index): 1 and 2 threads give the same tokens."""
    weight = random_weight(GGMLType.Q4_K, (40_000, 256), torch.Generator().manual_seed(5))
    x, inv_t, keys = inputs(4, 256, torch.bfloat16, 5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fh.fused_head(x, weight, inv_t, keys)
        torch.set_num_threads(2)
        two = fh.fused_head(x, weight, inv_t, keys)
    finally:
        torch.set_num_threads(threads)
    assert one[0].tolist() == two[0].tolist()


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_other_gemv_paths_draw_the_same_tokens(march: str) -> None:
    """The AVX2 and generic C builds (the GEMV's other dot-product paths) draw what the native build draws (a
    repacked head too, whose tail tile is 9 rows: Q6_K_R16's products take x unsigned on the VNNI path)."""
    if platform.machine() != "x86_64":
        pytest.skip("x86-64 targets")
    flags = (*(f for f in fh.CFLAGS if not f.startswith("-march=")), f"-march={march}")
    lib = fh.load(fh.build(flags))
    for qtype in (GGMLType.Q8_0, GGMLType.Q5_1, GGMLType.Q6_K, GGMLType.Q8_0_R16, GGMLType.Q6_K_R16):
        weight = random_weight(qtype, (5 * HEAD_CHUNK + 9, 256), torch.Generator().manual_seed(int(qtype)))
        for rows in (1, 3):
            x, inv_t, keys = inputs(rows, 256, torch.float32, rows)
            got = fh.fused_head(x, weight, inv_t, keys, lib=lib)
            assert got[0].tolist() == fh.fused_head(x, weight, inv_t, keys)[0].tolist()


def test_refuses_what_it_does_not_take() -> None:
    """More rows than one GEMV pass, another dtype, a K that does not match, a top_k above MAX_TOP_K."""
    weight = random_weight(GGMLType.Q8_0, (64, 64), torch.Generator().manual_seed(0))
    inv_t, keys = torch.zeros(1), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="rows"):
        over = fh.MAX_ROWS + 1
        fh.fused_head(torch.zeros(over, 64), weight, torch.zeros(over), torch.zeros(over, dtype=torch.int64))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        fh.fused_head(torch.zeros(1, 64, dtype=torch.float16), weight, inv_t, keys)
    with pytest.raises(ValueError, match="cannot multiply"):
        fh.fused_head(torch.zeros(1, 32), weight, inv_t, keys)
    wide = random_weight(GGMLType.Q8_0, (fh.MAX_TOP_K + 2, 64), torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="top_k"):
        fh.fused_head(torch.zeros(1, 64), wide, torch.ones(1), keys, top_k=torch.tensor([fh.MAX_TOP_K + 1]))


def test_max_rows_in_one_call_and_the_c_op_refuses_more(monkeypatch: pytest.MonkeyPatch) -> None:
    """MAX_ROWS (cpu_quant.GEMV_MAX_ROWS) rows in one call draw the unfused tokens; one more row, let past the
    Python check, the C op refuses itself: its HEAD_MAX_ROWS (cpu_quant.c's MAX_ROWS) is the same number."""
    vocab, k = HEAD_CHUNK + 5, 64
    weight = random_weight(GGMLType.Q8_0, (vocab, k), torch.Generator().manual_seed(3))
    x, inv_t, keys = inputs(fh.MAX_ROWS, k, torch.float32, 3)
    tokens, status = fh.fused_head(x, weight, inv_t, keys)
    want_tokens, want_status = reference(x, weight, inv_t, keys)
    assert status.tolist() == want_status.tolist() == [0] * fh.MAX_ROWS
    assert tokens.tolist() == want_tokens.tolist()
    x, inv_t, keys = inputs(fh.MAX_ROWS + 1, k, torch.float32, 4)
    monkeypatch.setattr(fh, "MAX_ROWS", fh.MAX_ROWS + 1)
    with pytest.raises(ValueError, match="refused its arguments"):
        fh.draw(x, weight, inv_t, keys)


def test_eligible_rows_have_no_min_p_and_a_small_top_k() -> None:
    """min_p, and a top_k above MAX_TOP_K below the vocabulary, make a batch ineligible; top_p does not."""
    big = fh.MAX_TOP_K + 1
    k, p, m = torch.tensor([0, 50]), torch.tensor([1.0, 0.9]), torch.tensor([0.0, 0.0])
    assert fh.eligible(k, p, m, vocab=50_000)
    assert fh.eligible(torch.tensor([0, big]), p, m, vocab=big)
    assert not fh.eligible(torch.tensor([0, big]), p, m, vocab=big + 1)
    assert not fh.eligible(k, p, torch.tensor([0.0, 0.1]), vocab=50_000)


def test_truncates_means_fewer_tokens_than_the_vocabulary() -> None:
    """top_k below the vocabulary or top_p below 1 on some row truncates; 0, the vocabulary or more, and 1 do not."""
    ones = torch.ones(2)
    assert not fh.truncates(torch.tensor([0, 100]), ones, vocab=100)
    assert fh.truncates(torch.tensor([0, 99]), ones, vocab=100)
    assert fh.truncates(torch.tensor([0, 0]), torch.tensor([1.0, 0.95]), vocab=100)


# (top_k, top_p) per row of the truncation tests: k alone, p alone, both, k beyond the vocabulary (disabled)
TRUNCATIONS = [(5, 1.0), (0, 0.9), (50, 0.8), (1, 1.0), (0, 0.5), (300, 0.99), (10**6, 1.0), (0, 0.999)]


@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("spread", [8.0, 0.5])
def test_top_k_top_p_equal_the_unfused_pair(qtype: GGMLType, dtype: torch.dtype, spread: float) -> None:
    """top_k, top_p and both, greedy rows beside them, on peaked logits (the candidates decide every row) and on
    flat ones (nuclei of thousands of tokens: some rows fall back to their logits): the unfused tokens, always."""
    vocab, k = 60 * HEAD_CHUNK + 77, 256
    weight = random_weight(qtype, (vocab, k), torch.Generator().manual_seed(int(spread * 10)))
    decided = 0
    for seed in range(4):
        rows = 4
        x, inv_t, keys = inputs(rows, k, dtype, seed)
        x = (x.float() * (spread / 8.0)).to(dtype)
        picks = [TRUNCATIONS[(seed * rows + r) % len(TRUNCATIONS)] for r in range(rows)]
        top_k = torch.tensor([kk for kk, _ in picks], dtype=torch.int64)
        top_p = torch.tensor([pp for _, pp in picks], dtype=torch.float32)
        tokens, status = fh.fused_head(x, weight, inv_t, keys, top_k, top_p)
        want_tokens, want_status = reference(x, weight, inv_t, keys, top_k, top_p)
        assert status.tolist() == want_status.tolist() == [0] * rows
        assert tokens.tolist() == want_tokens.tolist(), (picks, inv_t.tolist())
        raw_status = fh.draw(x, weight, inv_t, keys, top_k, top_p)[1]
        decided += int((raw_status == 0).sum())
    if spread > 1.0:
        assert decided == 16  # peaked rows: the candidates always prove the kept set


def test_top_p_undecided_rows_fall_back() -> None:
    """A flat row whose nucleus is far larger than the candidates is left undecided by the C op (FALLBACK) and
    drawn from its logits: the unfused token."""
    vocab, k = 40 * HEAD_CHUNK, 64
    weight = random_weight(GGMLType.Q8_0, (vocab, k), torch.Generator().manual_seed(9))
    x = torch.full((1, k), 1e-3)
    inv_t, keys, top_p = torch.ones(1), torch.tensor([rng_key(3, 0, 0)]), torch.tensor([0.95])
    assert fh.draw(x, weight, inv_t, keys, top_p=top_p)[1].tolist() == [fh.FALLBACK]
    tokens, status = fh.fused_head(x, weight, inv_t, keys, top_p=top_p)
    assert (tokens.tolist(), status.tolist()) == tuple(
        t.tolist() for t in reference(x, weight, inv_t, keys, top_p=top_p)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_truncated_rows_write_their_logits(dtype: torch.dtype) -> None:
    """Given a buffer, the op writes the top_k / top_p rows' logits there (the unfused GEMV's, bit for bit) and
    leaves the other rows' alone; a fallen-back row is drawn from them without a second GEMV: the unfused token."""
    vocab, k = 40 * HEAD_CHUNK + 5, 64
    weight = random_weight(GGMLType.Q8_0, (vocab, k), torch.Generator().manual_seed(11))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(12)).to(dtype)
    x[1] = 1e-3  # flat: its nucleus is far larger than the candidates
    inv_t, keys = torch.tensor([0.0, 1.0, 1.0]), torch.tensor([rng_key(4, r, 0) for r in range(3)])
    top_k, top_p = torch.tensor([0, 0, 40]), torch.tensor([1.0, 0.95, 1.0])
    logits = torch.full((4, vocab), 7.0, dtype=dtype)
    tokens, status = fh.draw(x, weight, inv_t, keys, top_k, top_p, logits=logits)
    assert status.tolist() == [0, fh.FALLBACK, 0]
    want = qmatmul(x, weight, backend="cpu")
    assert torch.equal(logits[1:3], want[1:3])
    assert bool((logits[0] == 7.0).all()) and bool(
        (logits[3] == 7.0).all()
    )  # greedy and unused rows untouched
    assert fh.sample_undecided(x[:0], weight, inv_t, keys, top_k, top_p, tokens, status, logits) == 1
    want_tokens, want_status = reference(x, weight, inv_t, keys, top_k, top_p)
    assert (tokens.tolist(), status.tolist()) == (want_tokens.tolist(), want_status.tolist())
    with pytest.raises(ValueError, match="logits"):
        fh.draw(x, weight, inv_t, keys, top_k, top_p, logits=torch.empty(2, vocab, dtype=dtype))


def test_top_p_counts_the_mass_outside_the_candidates() -> None:
    """A top_p row whose nucleus lies among its candidates but a quarter of whose mass is in tokens outside them
    (200 tokens at logits 6-7 over 51,000 at -0.5-0): the C op must count the dropped tokens' mass, or it decides
    a nucleus too small and its draws differ from the unfused pair's. Logits laid out as Q8_0 blocks times
    x = e_0."""
    vocab, k = 400 * HEAD_CHUNK, 32
    g = torch.Generator().manual_seed(5)
    logits = -0.5 * torch.rand(vocab, generator=g)
    logits[torch.randperm(vocab, generator=g)[:200]] = 6.0 + torch.rand(200, generator=g)
    raw = torch.zeros(vocab, 34, dtype=torch.uint8)
    raw[:, :2] = (logits / 100.0).to(torch.float16).view(torch.uint8).reshape(vocab, 2)
    raw[:, 2] = 100  # q of element 0; the other 31 are 0
    weight = QuantizedTensor(raw, GGMLType.Q8_0, (vocab, k))
    rows = 16
    x = torch.zeros(rows, k)
    x[:, 0] = 1.0
    inv_t, top_p = torch.ones(rows), torch.full((rows,), 0.5)
    for call in range(4):
        keys = torch.tensor([rng_key(11, call, r) for r in range(rows)], dtype=torch.int64)
        tokens, status = fh.draw(x, weight, inv_t, keys, top_p=top_p)
        assert status.tolist() == [0] * rows  # decided from the candidates, not sampled from the logits
        assert tokens.tolist() == reference(x, weight, inv_t, keys, top_p=top_p)[0].tolist()


def test_top_k_ties_at_the_kth_value_are_all_kept() -> None:
    """Rows of equal logits copied across chunks: top_k = 2 keeps every row tied at the 2nd value (the sort-based
    rule); draws over many keys land on each of them and on nothing else."""
    vocab, k = 20 * HEAD_CHUNK + 3, 64
    weight = random_weight(GGMLType.Q8_0, (vocab, k), torch.Generator().manual_seed(4))
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(4))
    order = qmatmul(x, weight, backend="cpu")[0].argsort(descending=True).tolist()
    rows = weight.data.view(vocab, -1)
    second = order[1]
    tied = [second, (second + 5 * HEAD_CHUNK) % vocab, (second + 11 * HEAD_CHUNK + 7) % vocab]
    for at in tied[1:]:
        rows[at] = rows[second]
    kept = {order[0], *tied}
    seen = set()
    for key in range(64):
        keys = torch.tensor([rng_key(key, 0, 0)])
        got = fh.fused_head(x, weight, torch.tensor([0.25]), keys, top_k=torch.tensor([2]))
        want = reference(x, weight, torch.tensor([0.25]), keys, top_k=torch.tensor([2]))
        assert got[0].tolist() == want[0].tolist()
        seen.add(int(got[0]))
    assert seen <= kept and len(seen) >= 3, (seen, kept)


def _p_value(statistic: float, dof: int) -> float:
    """Upper tail of the chi-square distribution (the regularized upper incomplete gamma function)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(statistic / 2.0)))


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 0, 1.0), (1.0, 4, 1.0), (1.0, 0, 0.8)],
)
def test_draws_fit_the_exact_softmax(temperature: float, top_k: int, top_p: float) -> None:
    """32,000 draws (16 rows a call, keys from 32,000 positions) from a 10-token head against softmax(logits / T)
    of the logits the GEMV computes, over the tokens top_k / top_p keep (deterministic: fixed keys)."""
    draws, rows, k = 32_000, 16, 64
    g = torch.Generator().manual_seed(11)
    weight = random_weight(GGMLType.Q8_0, (10, k), g, scale=0.002)
    x = torch.randn(1, k, generator=g).expand(rows, k).contiguous()
    logits = qmatmul(x[:1], weight, backend="cpu")[0]
    inv_t = torch.full((rows,), 1.0 / temperature, dtype=torch.float32)
    counts = torch.zeros(10, dtype=torch.float64)
    for start in range(0, draws, rows):
        keys = torch.tensor([rng_key(2024, 0, p) for p in range(start, start + rows)], dtype=torch.int64)
        ks, ps = torch.full((rows,), top_k), torch.full((rows,), top_p)
        tokens, status = fh.draw(x, weight, inv_t, keys, ks, ps)  # the C op alone: it decides every row here
        assert status.tolist() == [0] * rows
        counts += torch.bincount(tokens, minlength=10).to(torch.float64)
    scaled = logits * inv_t[0]
    kept = sorted_kept_mask(scaled, top_k, top_p, 0.0)
    assert float(counts[~kept].sum()) == 0.0  # a dropped token is never drawn
    expected = exact_probabilities(scaled, kept)[kept] * draws
    assert float(expected.min()) > 20, expected  # every cell large enough for the chi-square approximation
    statistic = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert _p_value(statistic, int(kept.sum()) - 1) > 1e-3, (statistic, counts.tolist(), expected.tolist())
