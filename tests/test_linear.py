"""linear_attention / LinearAttention / linear_attention_step against a float64 kernel sum."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from handformer import LinearAttention, LinearAttentionState, linear_attention
from handformer import linear_attention_step as step
from handformer.masks import causal_mask
from variant_reference import compare, elu1, kernel_reference, padding_keep, qkv

DTYPES = [torch.float32, torch.float64]

# (L_q, L_k): odd / prime lengths, chunk boundaries (64), L_q != L_k both ways.
CASES = [(1, 1), (7, 7), (13, 5), (5, 13), (64, 64), (131, 131), (97, 131), (131, 97), (200, 3)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L_q, L_k", CASES)
def test_matches_kernel_reference(L_q, L_k, causal, dtype):
    allowed = causal_mask(L_q, L_k) if causal else None
    compare(lambda q, k, v, **kw: linear_attention(q, k, v, causal=causal, **kw),
            lambda q, k, v: kernel_reference(q, k, v, allowed), L_q, L_k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_padded_batch_and_float_key_masks(causal, dtype):
    L = 139
    allowed = causal_mask(L, L) if causal else None
    keep = padding_keep([139, 45], L)  # (B, 1, 1, L_k)
    compare(lambda q, k, v, **kw: linear_attention(q, k, v, causal=causal, **kw),
            lambda q, k, v: kernel_reference(q, k, v, allowed, key_weight=keep), L, L, dtype,
            mask=keep)
    bias = torch.randn(2, 3, 1, L, dtype=dtype).masked_fill(torch.rand(2, 3, 1, L) > 0.7,
                                                           float("-inf"))
    compare(lambda q, k, v, **kw: linear_attention(q, k, v, causal=causal, **kw),
            lambda q, k, v: kernel_reference(q, k, v, allowed, key_bias=bias), L, L,
            dtype, mask=bias)


@pytest.mark.parametrize("feature_map, phi", [("relu", F.relu), (torch.exp, torch.exp)])
def test_other_feature_maps(feature_map, phi):
    compare(lambda q, k, v, **kw: linear_attention(q, k, v, causal=True, feature_map=feature_map,
                                                   eps=1e-3, **kw),
            lambda q, k, v: kernel_reference(q, k, v, causal_mask(70, 70), phi=phi, eps=1e-3),
            70, 70, torch.float64)


def test_per_query_masks_are_rejected_with_a_reason():
    q, k, v = qkv(6, 6)
    for bad in (torch.ones(6, 6, dtype=torch.bool), causal_mask(6, 6)[None, None]):
        with pytest.raises(ValueError, match=r"only key masks .*\(\.\.\., 1, L_k\)"):
            linear_attention(q, k, v, mask=bad)
    with pytest.raises(TypeError, match="dtype"):
        linear_attention(q, k, v, mask=torch.ones(1, 6, dtype=torch.int64))
    out, _ = linear_attention(q, k, v, mask=torch.ones(6, dtype=torch.bool))  # 1-D key mask
    torch.testing.assert_close(out, kernel_reference(q, k, v)[0], atol=1e-10, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_empty_rows_are_zero_not_nan(dtype):
    q, k, v = qkv(20, 9, dtype=dtype, requires_grad=True)
    keep = padding_keep([9, 0], 9)
    out, w = linear_attention(q, k, v, causal=True, mask=keep, need_weights=True)
    out.sum().backward()
    assert out.dtype == dtype
    assert not torch.isnan(out).any() and not torch.isnan(w).any()
    assert (out[1] == 0).all() and (out[0, :, :11] == 0).all()
    for t in (q, k, v):
        assert not torch.isnan(t.grad).any()
    ref, _ = kernel_reference(q, k, v, causal_mask(20, 9), key_weight=keep)
    torch.testing.assert_close(out.double(), ref.detach(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck(causal):
    q, k, v = qkv(9, 11, batch=(2,), D=3, D_v=2, requires_grad=True)
    keep = padding_keep([11, 5], 11).squeeze(1)  # (B, 1, L_k)
    assert torch.autograd.gradcheck(
        lambda q, k, v: linear_attention(q, k, v, causal=causal, mask=keep)[0], (q, k, v),
        fast_mode=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_step_token_by_token_equals_causal_form(dtype):
    q, k, v = qkv(70, 70, dtype=dtype)
    keep = padding_keep([70, 70], 70)
    keep[1, ..., 3] = False  # a padded key in the middle of the second sequence
    full, _ = linear_attention(q, k, v, causal=True, mask=keep)
    state, outs = None, []
    for t in range(70):
        out, state = step(q[..., t:t + 1, :], k[..., t:t + 1, :], v[..., t:t + 1, :], state,
                          mask=keep[..., t:t + 1])
        outs.append(out)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(torch.cat(outs, dim=-2), full, atol=tol, rtol=0)
    assert state.kv.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    fk = elu1(k.double()) * keep.transpose(-2, -1)  # (B, H, L, D)
    torch.testing.assert_close(state.kv.double(), fk.transpose(-2, -1) @ v.double(),
                               atol=tol * 100, rtol=0)
    torch.testing.assert_close(state.k_sum.double(), fk.sum(-2), atol=tol * 100, rtol=0)


def test_step_in_pieces_and_float32_state_for_half_inputs():
    q, k, v = qkv(50, 50, dtype=torch.bfloat16)
    kind = LinearAttention()
    full, _ = kind(q, k, v, causal=True)
    out1, state = kind.step(q[..., :17, :], k[..., :17, :], v[..., :17, :])
    before = state.kv.clone()
    out2, state2 = kind.step(q[..., 17:, :], k[..., 17:, :], v[..., 17:, :], state)
    assert torch.equal(state.kv, before)  # the old state is not modified
    assert state2.kv.dtype == torch.float32 and out2.dtype == torch.bfloat16
    torch.testing.assert_close(torch.cat([out1, out2], dim=-2), full, atol=1e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="state"):
        kind.step(q[..., :1, :], k[..., :1, :], v[..., :1, :],
                  LinearAttentionState(kv=state.kv[:1], k_sum=state.k_sum[:1]))
    with pytest.raises(ValueError, match="tokens"):
        kind.step(q[..., :2, :], k[..., :1, :], v[..., :1, :])


def test_kind_pattern_and_validation():
    kind = LinearAttention(feature_map="relu", eps=1e-4)
    assert kind.pattern(5, 5) is None
    assert torch.equal(kind.pattern(4, 6, causal=True), causal_mask(4, 6))
    assert kind.supports_dropout is False
    q, k, v = qkv(6, 6)
    with pytest.raises(ValueError, match="dropout_p"):
        kind(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="feature_map"):
        LinearAttention(feature_map="softmax")
    with pytest.raises(TypeError, match="feature_map"):
        LinearAttention(feature_map=3)
    for bad in (0, -1e-3, "1e-6"):
        with pytest.raises(ValueError, match="eps"):
            LinearAttention(eps=bad)


def huge_bias(L: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, 1, L) key biases: ordinary ones, 1e4 (exp overflows even in float64), -1e4,
    -inf; the second sequence's first keys are all removed, and its 1e4 keys come late."""
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(2, 1, 1, L, generator=g, dtype=torch.float64) * 3
    bias[0, ..., ::7] = 1e4
    bias[1, ..., 150::9] = 1e4
    bias[..., 3::13] = -1e4
    bias[..., 5::11] = float("-inf")
    bias[1, ..., :20] = float("-inf")
    return bias.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L_q, L_k", [(300, 300), (140, 300), (300, 140)])
def test_huge_float_biases_are_stable(L_q, L_k, causal, dtype):
    """A float bias never makes NaN: it acts like a softmax bias (exp(b - max) per query)."""
    q, k, v = qkv(L_q, L_k, dtype=dtype, requires_grad=True)
    bias = huge_bias(L_k, dtype)
    out, w = linear_attention(q, k, v, bias, causal=causal, need_weights=True)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(w).all()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    allowed = causal_mask(L_q, L_k) if causal else None
    ref_out, ref_w = kernel_reference(q, k, v, allowed, key_bias=bias)  # the bias as given
    tol = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 3e-3,
           torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(out.double(), ref_out.detach(), atol=tol, rtol=tol)
    torch.testing.assert_close(w.double(), ref_w, atol=tol, rtol=tol)
    if dtype == torch.float64:  # shift-invariant (in float64, where b - 5e3 is still exact)
        shifted, _ = linear_attention(q, k, v, bias - 5e3, causal=causal)
        torch.testing.assert_close(shifted, out, atol=tol, rtol=tol)


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_through_float_biases(causal):
    q, k, v = qkv(9, 11, batch=(2,), D=3, D_v=2, requires_grad=True)
    bias = (torch.randn(2, 1, 11, dtype=torch.float64) * 50).requires_grad_(True)
    with torch.no_grad():
        bias[1, 0, 3] = float("-inf")
    assert torch.autograd.gradcheck(
        lambda q, k, v, b: linear_attention(q, k, v, b, causal=causal)[0], (q, k, v, bias),
        fast_mode=True)


def test_step_with_float_biases_equals_causal_form():
    """The recurrent state keeps the running bias maximum: pieces give the one-call result,
    also after bias-free steps and with 1e4 biases arriving late."""
    q, k, v = qkv(300, 300)
    bias = huge_bias(300, torch.float64)
    bias[..., :40] = 0.0  # the first steps see no float bias at all
    full, _ = linear_attention(q, k, v, bias, causal=True)
    state, outs = None, []
    for t0, t1 in ((0, 40), (40, 41), (41, 170), (170, 300)):
        mask = None if t1 <= 40 else bias[..., t0:t1]
        out, state = step(q[..., t0:t1, :], k[..., t0:t1, :], v[..., t0:t1, :], state,
                          mask=mask)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=-2), full, atol=1e-10, rtol=0)
    assert state.bias_max is not None and torch.isfinite(state.kv).all()
