"""Every path of the attention functions equals ``attention_reference``, the ten-line maths.

``attention_reference`` is ``softmax(q kᵀ · scale + mask) v`` and nothing else; the functions
built for speed and safety (torch's fused kernel, the explicit path with weights, grouped-query
heads, rows with no allowed key, local and strided attention in tiles) must give the same
numbers in float64. The patterns (causal, window, strided) are written here entry by entry
from their definitions, not taken from ``handformer.masks``; grouped-query heads are repeated
here with ``repeat_interleave``. The reference itself is checked against numbers worked by
hand, so that a wrong reference cannot make everything agree.
"""

from __future__ import annotations

import math

import pytest
import torch

from handformer.attention import (
    attention_reference,
    local_attention,
    scaled_dot_product_attention,
    strided_attention,
)

TOL = dict(rtol=1e-10, atol=1e-12)
B, H, D = 2, 4, 8


def qkv(L_q: int, L_k: int, *, kv_heads: int = H, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L_q, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, kv_heads, L_k, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, kv_heads, L_k, D + 2, generator=g, dtype=torch.float64)
    return q, k, v


def pattern(L_q: int, L_k: int, allowed) -> torch.Tensor:  # noqa: ANN001 - (p, j) -> bool
    """``(L_q, L_k)`` bool: query ``i`` sits at key position ``p = i + L_k - L_q``."""
    return torch.tensor([[bool(allowed(i + L_k - L_q, j)) for j in range(L_k)]
                         for i in range(L_q)])


def causal(L_q: int, L_k: int) -> torch.Tensor:
    return pattern(L_q, L_k, lambda p, j: j <= p)


def assert_equal_to_reference(got: tuple, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              mask: torch.Tensor | None, **kwargs: object) -> None:
    out, weights = attention_reference(q, k, v, mask, **kwargs)
    torch.testing.assert_close(got[0], out, **TOL)
    if got[1] is not None:
        torch.testing.assert_close(got[1], weights, **TOL)


def test_the_reference_is_the_formula_worked_by_hand() -> None:
    q = torch.tensor([[1.0, 0.0]], dtype=torch.float64)  # one query, D = 2
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], dtype=torch.float64)
    v = torch.tensor([[1.0], [10.0], [100.0]], dtype=torch.float64)
    s = 1 / math.sqrt(2)  # the scores are s, 0, -s
    e = [math.exp(s), 1.0, math.exp(-s)]
    out, w = attention_reference(q, k, v)
    torch.testing.assert_close(w[0], torch.tensor(e, dtype=torch.float64) / sum(e), **TOL)
    assert out.item() == pytest.approx((e[0] + 10 * e[1] + 100 * e[2]) / sum(e), rel=1e-12)
    out, w = attention_reference(q, k, v, torch.tensor([[True, False, True]]), scale=2.0)
    assert w[0, 1] == 0 and out.item() == pytest.approx(
        (math.exp(2) + 100 * math.exp(-2)) / (math.exp(2) + math.exp(-2)), rel=1e-12)
    out, w = attention_reference(q, k, v, torch.tensor([[0.0, math.log(2), -math.inf]],
                                                  dtype=torch.float64),
                                 softcap=0.5)
    c = [math.exp(0.5 * math.tanh(s / 0.5)), 2 * math.exp(0.0)]  # capped, biased, dropped
    assert out.item() == pytest.approx((c[0] + 10 * c[1]) / sum(c), rel=1e-12)
    out, w = attention_reference(q, k, v, torch.tensor([[False, False, False]]))
    assert out.item() == 0 and not w.any()  # a row with no allowed key is zero, not NaN


@pytest.mark.parametrize("need_weights", [False, True])  # torch's fused kernel / the explicit path
@pytest.mark.parametrize("case", ["none", "bool", "float", "causal", "causal+bool",
                                  "causal+float", "empty rows", "float empty rows", "scale"])
def test_scaled_dot_product_attention(case: str, need_weights: bool) -> None:
    L_q, L_k = 5, 7  # causal is bottom-right aligned: L_q != L_k checks it
    q, k, v = qkv(L_q, L_k)
    g = torch.Generator().manual_seed(1)
    keep = torch.rand(B, 1, L_q, L_k, generator=g) < 0.6
    bias = torch.randn(B, 1, L_q, L_k, generator=g, dtype=torch.float64)
    mask, ref_mask, kwargs = None, None, {}
    if case in ("bool", "causal+bool", "empty rows"):
        mask = ref_mask = keep
    if case == "empty rows":
        mask = ref_mask = keep & torch.tensor([True, False, True, False, True])[:, None]
    if case in ("float", "causal+float"):
        mask = ref_mask = bias
    if case == "float empty rows":
        mask = ref_mask = bias.masked_fill(torch.tensor([False, True, False, False, True])
                                           [:, None], -math.inf)
    is_causal = case.startswith("causal")
    if is_causal:
        c = causal(L_q, L_k)
        ref_mask = c if ref_mask is None else (ref_mask & c if ref_mask.dtype == torch.bool
                                               else ref_mask.masked_fill(~c, -math.inf))
    if case == "scale":
        kwargs = {"scale": 0.37}
    got = scaled_dot_product_attention(q, k, v, mask, causal=is_causal,
                                       need_weights=need_weights, **kwargs)
    assert (got[1] is not None) == need_weights
    assert_equal_to_reference(got, q, k, v, ref_mask, **kwargs)


def test_square_causal_and_dropout_zero() -> None:
    q, k, v = qkv(6, 6)
    for need_weights in (False, True):  # the fused is_causal flag; the explicit path
        got = scaled_dot_product_attention(q, k, v, causal=True, need_weights=need_weights,
                                           dropout_p=0.0)
        assert_equal_to_reference(got, q, k, v, causal(6, 6))


def test_softcap() -> None:
    q, k, v = qkv(4, 6)
    got = scaled_dot_product_attention(3 * q, k, v, causal=True, softcap=1.5)
    assert_equal_to_reference(got, 3 * q, k, v, causal(4, 6), softcap=1.5)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_grouped_query_heads(need_weights: bool, masked: bool) -> None:
    q, k, v = qkv(5, 7, kv_heads=2)
    mask = torch.rand(B, 1, 5, 7, generator=torch.Generator().manual_seed(2)) < 0.7
    mask = mask if masked else None
    got = scaled_dot_product_attention(q, k, v, mask, causal=True, enable_gqa=True,
                                       need_weights=need_weights)
    full_k, full_v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # head h: h//2
    c = causal(5, 7)
    assert_equal_to_reference(got, q, full_k, full_v, c if mask is None else mask & c)


@pytest.mark.parametrize(("L_q", "L_k"), [(9, 9), (4, 11), (300, 300)])  # 300: several tiles
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
def test_local_attention(L_q: int, L_k: int, is_causal: bool, need_weights: bool) -> None:
    q, k, v = qkv(L_q, L_k)
    w = 5
    got = local_attention(q, k, v, window_size=w, causal=is_causal, need_weights=need_weights)
    window = pattern(L_q, L_k, lambda p, j: abs(p - j) <= w // 2 and (j <= p or not is_causal))
    assert_equal_to_reference(got, q, k, v, window)


def test_local_attention_mask_and_softcap() -> None:
    q, k, v = qkv(9, 9)
    keep = torch.rand(B, 1, 9, 9, generator=torch.Generator().manual_seed(3)) < 0.5
    for need_weights in (False, True):
        got = local_attention(3 * q, k, v, keep, window_size=3, softcap=2.0,
                              need_weights=need_weights)
        window = pattern(9, 9, lambda p, j: abs(p - j) <= 1)
        assert_equal_to_reference(got, 3 * q, k, v, keep & window, softcap=2.0)


@pytest.mark.parametrize(("L_q", "L_k"), [(12, 12), (5, 13)])
@pytest.mark.parametrize("global_tokens", [0, 2])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
def test_strided_attention(L_q: int, L_k: int, global_tokens: int, is_causal: bool,
                           need_weights: bool) -> None:
    q, k, v = qkv(L_q, L_k)
    s, g = 3, global_tokens
    got = strided_attention(q, k, v, stride=s, global_tokens=g, causal=is_causal,
                            need_weights=need_weights)

    def allowed(p: int, j: int) -> bool:
        seen = abs(p - j) < s or (p - j) % s == 0 or p < g or j < g
        return seen and (j <= p or not is_causal)

    assert_equal_to_reference(got, q, k, v, pattern(L_q, L_k, allowed))


def test_strided_attention_with_a_float_mask() -> None:
    q, k, v = qkv(10, 10)
    bias = torch.randn(B, 1, 10, 10, generator=torch.Generator().manual_seed(4),
                       dtype=torch.float64)
    got = strided_attention(q, k, v, bias, stride=4, need_weights=True)
    strided = pattern(10, 10, lambda p, j: abs(p - j) < 4 or (p - j) % 4 == 0)
    assert_equal_to_reference(got, q, k, v, bias.masked_fill(~strided, -math.inf))
