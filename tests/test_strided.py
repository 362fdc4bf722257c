"""strided_attention / StridedAttention against a dense float64 reference with strided_mask."""

from __future__ import annotations

import pytest
import torch

from handformer import FullAttention, StridedAttention, strided_attention
from handformer.masks import strided_mask
from variant_reference import compare, padding_keep, qkv, softmax_reference

DTYPES = [torch.float32, torch.float64]

# (L_q, L_k, stride, global_tokens): odd / prime lengths, L_q != L_k both ways, stride 1,
# strides that do not divide the length, stride > L, global tokens (also more than L).
CASES = [
    (1, 1, 1, 0), (13, 13, 1, 0), (13, 13, 3, 0), (131, 131, 11, 0), (131, 97, 7, 2),
    (97, 131, 7, 3), (59, 59, 5, 60), (23, 41, 100, 1), (140, 29, 4, 0), (29, 140, 13, 5),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L_q, L_k, s, g", CASES)
def test_matches_dense_reference(L_q, L_k, s, g, causal, dtype):
    allowed = strided_mask(L_q, L_k, s, global_tokens=g, causal=causal)
    compare(lambda q, k, v, **kw: strided_attention(q, k, v, stride=s, global_tokens=g,
                                                    causal=causal, **kw),
            lambda q, k, v: softmax_reference(q, k, v, allowed), L_q, L_k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_padded_batch_key_masks(causal, dtype):
    L = 137
    keep = padding_keep([137, 50], L)  # (B, 1, 1, L_k)
    allowed = strided_mask(L, L, 12, global_tokens=2, causal=causal) & keep
    compare(lambda q, k, v, **kw: strided_attention(q, k, v, stride=12, global_tokens=2,
                                                    causal=causal, **kw),
            lambda q, k, v: softmax_reference(q, k, v, allowed), L, L, dtype, mask=keep)


@pytest.mark.parametrize("dtype", DTYPES)
def test_full_bool_and_float_masks(dtype):
    L_q, L_k = 61, 67
    keep = torch.rand(3, L_q, L_k) > 0.4  # per-head masks
    allowed = strided_mask(L_q, L_k, 6, global_tokens=1) & keep
    compare(lambda q, k, v, **kw: strided_attention(q, k, v, stride=6, global_tokens=1, **kw),
            lambda q, k, v: softmax_reference(q, k, v, allowed), L_q, L_k, dtype, mask=keep)
    bias = torch.randn(2, 1, L_q, L_k, dtype=dtype)
    bias = bias.masked_fill(torch.rand(2, 1, L_q, L_k) > 0.7, float("-inf"))
    pattern = strided_mask(L_q, L_k, 6, causal=True)
    compare(lambda q, k, v, **kw: strided_attention(q, k, v, stride=6, causal=True, **kw),
            lambda q, k, v: softmax_reference(q, k, v, pattern, bias), L_q, L_k, dtype,
            mask=bias)
    row_mask = torch.rand(L_q, 1) > 0.3  # masks whole query rows
    pattern = strided_mask(L_q, L_k, 6, global_tokens=2)
    compare(lambda q, k, v, **kw: strided_attention(q, k, v, stride=6, global_tokens=2, **kw),
            lambda q, k, v: softmax_reference(q, k, v, pattern & row_mask), L_q, L_k, dtype,
            mask=row_mask)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_empty_rows_are_zero_not_nan(dtype):
    q, k, v = qkv(30, 12, dtype=dtype, requires_grad=True)
    keep = padding_keep([12, 0], 12)
    out, w = strided_attention(q, k, v, stride=4, global_tokens=1, causal=True, mask=keep,
                               need_weights=True)
    out.sum().backward()
    assert not torch.isnan(out).any() and not torch.isnan(w).any()
    assert (out[1] == 0).all() and (out[0, :, :18] == 0).all()
    for t in (q, k, v):
        assert not torch.isnan(t.grad).any()
    allowed = strided_mask(30, 12, 4, global_tokens=1, causal=True) & keep
    ref_out, _ = softmax_reference(q, k, v, allowed)
    torch.testing.assert_close(out.double(), ref_out.detach(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck(causal):
    q, k, v = qkv(8, 10, batch=(2,), D=3, D_v=2, requires_grad=True)
    keep = padding_keep([10, 6], 10).squeeze(1)  # (B, 1, L_k)
    assert torch.autograd.gradcheck(
        lambda q, k, v: strided_attention(q, k, v, stride=3, global_tokens=1, mask=keep,
                                          causal=causal)[0],
        (q, k, v), fast_mode=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("stride", [1, 500])
def test_stride_one_or_beyond_length_is_full_attention(stride, causal):
    q, k, v = qkv(31, 43)
    keep = padding_keep([43, 17], 43)
    out, w = StridedAttention(stride)(q, k, v, causal=causal, mask=keep, need_weights=True)
    ref, ref_w = FullAttention()(q, k, v, causal=causal, mask=keep, need_weights=True)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(w, ref_w, atol=1e-10, rtol=0)


def test_kind_pattern_and_validation():
    kind = StridedAttention(4, global_tokens=2)
    assert torch.equal(kind.pattern(9, 12, causal=True),
                       strided_mask(9, 12, 4, global_tokens=2, causal=True))
    assert kind.supports_dropout is False
    q, k, v = qkv(6, 6)
    with pytest.raises(ValueError, match="dropout_p"):
        kind(q, k, v, dropout_p=0.1)
    for bad in (0, -1, 1.5, None):
        with pytest.raises(ValueError, match="stride"):
            StridedAttention(bad)
        with pytest.raises(ValueError, match="stride"):
            strided_attention(q, k, v, stride=bad)
    for bad in (-1, 0.5, True):
        with pytest.raises(ValueError, match="global_tokens"):
            StridedAttention(3, global_tokens=bad)


def test_work_is_subquadratic():
    """The pattern's entries are the only scores computed (plus tile slack), not L x L."""
    L, s = 1024, 32
    q, k, v = qkv(L, L, batch=(1,), D=4, dtype=torch.float32, requires_grad=True)
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        strided_attention(q, k, v, stride=s)
    assert max(sizes) < L * L // 8
