"""The explicit attention path that hooks on the scores or the pattern switch to.

``masked_scores`` / ``masked_softmax`` take shortcuts for speed (``torch.where`` instead of
``masked_fill``, one plain softmax when no row is empty): these tests hold them to the float64
reference, rows with no allowed key included, and to ``masked_fill``'s exact semantics.
"""

from __future__ import annotations

import pytest
import torch

from handformer.attention.functional import masked_scores, masked_softmax
from handformer.attention.kinds import FullAttention
from variant_reference import softmax_reference


def _inputs(L_q: int = 6, L_k: int = 7, D: int = 8) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, D, generator=g) for n in (L_q, L_k, L_k))
    return q, k, v


def test_causal_scores_and_pattern_match_float64_reference():
    q, k, v = _inputs(7, 7)
    allowed = torch.ones(7, 7).tril().bool()
    scores = masked_scores(q, k, None, causal=True, scale=0.3)
    assert torch.isneginf(scores[..., ~allowed]).all()
    pattern = masked_softmax(scores)
    _, ref = softmax_reference(q, k, v, allowed=allowed, scale=0.3)
    torch.testing.assert_close(pattern.double(), ref, atol=1e-6, rtol=1e-6)


def test_rows_with_no_allowed_key_are_zero_not_nan():
    q, k, v = _inputs()
    mask = torch.rand(2, 1, 6, 7, generator=torch.Generator().manual_seed(1)) > 0.4
    mask[0, :, 2] = False  # query row 2 of batch 0: no key allowed
    mask[1, :, 5] = False
    pattern = masked_softmax(masked_scores(q, k, mask))
    assert not pattern.isnan().any()
    assert (pattern[0, :, 2] == 0).all() and (pattern[1, :, 5] == 0).all()
    _, ref = softmax_reference(q, k, v, allowed=mask)
    torch.testing.assert_close(pattern.double(), ref, atol=1e-6, rtol=1e-6)


def test_a_masked_key_cannot_poison_the_row():
    """A NaN score at a masked position is dropped (as ``masked_fill`` does), not added to."""
    q, k, v = _inputs()
    k[:, :, 6] = float("nan")  # the last key is garbage (e.g. an uninitialised pad slot)
    mask = torch.ones(6, 7, dtype=torch.bool)
    mask[:, 6] = False
    scores = masked_scores(q, k, mask)
    assert torch.isneginf(scores[..., 6]).all()
    pattern = masked_softmax(scores)
    assert not pattern.isnan().any()
    _, ref = softmax_reference(q[..., :6, :], k[..., :6, :], v[..., :6, :])
    torch.testing.assert_close(pattern[..., :6].double(), ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("D", [8, 16, 64])  # scales 1/sqrt(8), then powers of two
def test_fast_path_equals_the_general_formula_bit_for_bit(D: int):
    """With no empty row the shortcut is the very softmax of the general formula; the
    scores are ``(q k^T) * scale`` masked, bit for bit, whichever way the scale is applied."""
    q, k, _ = _inputs(5, 9, D)
    kind = FullAttention()
    scores = kind.scores(q, k, causal=True)
    empty = torch.isneginf(scores).all(dim=-1, keepdim=True)
    general = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    assert torch.equal(kind.normalize(scores), general)
    expected = (torch.matmul(q, k.transpose(-2, -1)) * (1 / D ** 0.5)).masked_fill(
        ~torch.ones(5, 9).tril(4).bool(), float("-inf"))
    assert torch.equal(scores, expected)
