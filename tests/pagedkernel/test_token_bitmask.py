"""The token bitmask op: the C kernel and the torch path both mask exactly the tokens a bit-by-bit reading says."""

from __future__ import annotations

import pytest
import torch
from pagoda.pagedkernel.sampling import token_bitmask
from pagoda.pagedkernel.sampling.token_bitmask import apply_token_bitmask_, bitmask_words


def random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:  # int32 [rows, ceil(vocab / 32)]
    """Words of every kind a grammar produces: all allowed, all masked, and mixed."""
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(-(2**31), 2**31 - 1, (rows, bitmask_words(vocab)), dtype=torch.int32, generator=g)
    kind = torch.randint(0, 3, words.shape, generator=g)
    words[kind == 0] = 0
    words[kind == 1] = -1
    return words


def reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab: int) -> torch.Tensor:
    """Bit t % 32 of word t // 32, one token at a time; columns past the vocabulary are masked."""
    out = logits.clone()
    for r in rows:
        for t in range(out.shape[1]):
            if t >= vocab or not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("vocab", "width"), [(256, 256), (999, 999), (999, 1024)])
@pytest.mark.parametrize("use_c", [True, False])
def test_masks_exactly_the_cleared_bits(dtype: torch.dtype, vocab: int, width: int, use_c: bool) -> None:
    """Listed rows lose their cleared bits and the padded columns; unlisted rows are untouched."""
    if (
        use_c
    ):  # the C kernel is what this tests, not a fallback: a failing compiler fails here, with its stderr
        token_bitmask.load(token_bitmask.build())
        assert token_bitmask.c_kernel_available()
    logits = torch.randn(6, width, generator=torch.Generator().manual_seed(1)).to(dtype)
    bitmask = random_bitmask(8, vocab, seed=vocab)
    rows = [4, 0, 3]
    expected = reference(logits, bitmask, rows, vocab)
    apply_token_bitmask_(logits, bitmask, rows, vocab, use_c=use_c)
    assert torch.equal(logits, expected)


def test_strided_logits_rows() -> None:
    """A view whose rows sit further apart than their width (a slice of a wider buffer) is masked in place."""
    buffer = torch.randn(4, 300)
    beyond = buffer[:, 256:].clone()
    logits = buffer[:, :256]
    bitmask = random_bitmask(4, 256, seed=3)
    expected = reference(logits, bitmask, [1, 2], 256)
    apply_token_bitmask_(logits, bitmask, [1, 2], 256)
    assert torch.equal(logits, expected)
    assert torch.equal(buffer[:, 256:], beyond)  # the columns past the view are not the row's


def test_no_rows_is_a_no_op_and_bad_inputs_are_refused() -> None:
    """Nothing listed: nothing changes; a non-int32 bitmask, a short one or a row out of range: ValueError."""
    logits = torch.randn(2, 64)
    before = logits.clone()
    apply_token_bitmask_(logits, torch.zeros(2, 2, dtype=torch.int32), [], 64)
    assert torch.equal(logits, before)
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask_(logits, torch.zeros(2, 2, dtype=torch.int64), [0], 64)
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask_(logits, torch.zeros(2, 1, dtype=torch.int32), [0], 64)
    with pytest.raises(ValueError, match="outside"):
        apply_token_bitmask_(logits, torch.zeros(2, 2, dtype=torch.int32), [2], 64)
