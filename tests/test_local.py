"""local_attention / LocalAttention against a dense float64 reference with window_mask."""

from __future__ import annotations

import pytest
import torch

from handformer import CausalLMConfig, FullAttention, LocalAttention, local_attention
from handformer.attention.cache import WindowKVCache
from handformer.masks import window_mask
from variant_reference import compare, padding_keep, qkv, softmax_reference

DTYPES = [torch.float32, torch.float64]

# (L_q, L_k, window): odd / prime lengths, across the 128-row block boundary, L_q != L_k both
# ways, windows of 1, 3, covering the sequence and far larger than it (even sizes are refused).
CASES = [
    (1, 1, 1), (7, 7, 1), (13, 13, 3), (131, 131, 9), (131, 97, 17), (97, 131, 17),
    (257, 257, 33), (29, 29, 59), (11, 300, 1001), (300, 11, 5),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L_q, L_k, w", CASES)
def test_matches_dense_reference(L_q, L_k, w, causal, dtype):
    allowed = window_mask(L_q, L_k, w, causal=causal)
    compare(lambda q, k, v, **kw: local_attention(q, k, v, window_size=w, causal=causal, **kw),
            lambda q, k, v: softmax_reference(q, k, v, allowed), L_q, L_k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_padded_batch_key_masks(causal, dtype):
    L = 139
    keep = padding_keep([139, 60], L)  # (B, 1, 1, L_k): a full and a padded sequence
    allowed = window_mask(L, L, 21, causal=causal) & keep
    compare(lambda q, k, v, **kw: local_attention(q, k, v, window_size=21, causal=causal, **kw),
            lambda q, k, v: softmax_reference(q, k, v, allowed), L, L, dtype, mask=keep)


@pytest.mark.parametrize("dtype", DTYPES)
def test_full_bool_and_float_masks(dtype):
    L_q, L_k = 133, 140
    keep = torch.rand(L_q, L_k) > 0.4
    allowed = window_mask(L_q, L_k, 15) & keep
    compare(lambda q, k, v, **kw: local_attention(q, k, v, window_size=15, **kw),
            lambda q, k, v: softmax_reference(q, k, v, allowed), L_q, L_k, dtype, mask=keep)
    bias = torch.randn(2, 1, L_q, L_k, dtype=dtype)
    bias = bias.masked_fill(torch.rand(2, 1, L_q, L_k) > 0.7, float("-inf"))
    window = window_mask(L_q, L_k, 15)
    compare(lambda q, k, v, **kw: local_attention(q, k, v, window_size=15, **kw),
            lambda q, k, v: softmax_reference(q, k, v, window, bias), L_q, L_k, dtype,
            mask=bias)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_empty_rows_are_zero_not_nan(dtype):
    # L_q > L_k, causal: the first queries sit before key 0; batch 1 has every key masked.
    q, k, v = qkv(20, 9, dtype=dtype, requires_grad=True)
    keep = padding_keep([9, 0], 9)
    out, w = local_attention(q, k, v, window_size=5, causal=True, mask=keep, need_weights=True)
    out.sum().backward()
    assert not torch.isnan(out).any() and not torch.isnan(w).any()
    assert (out[1] == 0).all() and (out[0, :, :11] == 0).all()
    for t in (q, k, v):
        assert not torch.isnan(t.grad).any()
    assert (q.grad[1] == 0).all() and (q.grad[0, :, :11] == 0).all()
    ref_out, _ = softmax_reference(q, k, v, window_mask(20, 9, 5, causal=True) & keep)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref_out.detach(), atol=tol, rtol=tol)


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck(causal):
    q, k, v = qkv(9, 11, batch=(2,), D=4, D_v=3, requires_grad=True)
    keep = padding_keep([11, 6], 11).squeeze(1)  # (B, 1, L_k)
    assert torch.autograd.gradcheck(
        lambda q, k, v: local_attention(q, k, v, window_size=3, causal=causal, mask=keep)[0],
        (q, k, v), fast_mode=True)


@pytest.mark.parametrize("causal", [False, True])
def test_window_covering_the_sequence_is_full_attention(causal):
    q, k, v = qkv(37, 41)
    keep = padding_keep([41, 20], 41)
    local, full = LocalAttention(2 * 41 + 1), FullAttention()
    out, w = local(q, k, v, causal=causal, mask=keep, need_weights=True)
    ref, ref_w = full(q, k, v, causal=causal, mask=keep, need_weights=True)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(w, ref_w, atol=1e-10, rtol=0)


def test_kind_pattern_and_validation():
    kind = LocalAttention(5)
    assert torch.equal(kind.pattern(9, 12, causal=True), window_mask(9, 12, 5, causal=True))
    assert kind.supports_dropout is False
    q, k, v = qkv(6, 6)
    with pytest.raises(ValueError, match="dropout_p"):
        kind(q, k, v, dropout_p=0.1)
    for bad in (0, -3, 2.5, True, "3"):
        with pytest.raises(ValueError, match="window_size"):
            LocalAttention(bad)
        with pytest.raises(ValueError, match="window_size"):
            local_attention(q, k, v, window_size=bad)
    with pytest.raises(TypeError, match=r"window_size"):
        local_attention(q, k, v)  # the window is required, by keyword
    with pytest.raises(TypeError, match="dtype"):
        local_attention(q, k, v, window_size=3, mask=torch.ones(6, 6, dtype=torch.int64))
    with pytest.raises(ValueError, match="broadcast"):
        local_attention(q, k, v, window_size=3, mask=torch.ones(5, 6, dtype=torch.bool))


@pytest.mark.parametrize("even", [2, 4, 256])
def test_even_windows_are_refused_everywhere(even):
    """An even window would silently act as the next odd one: every entry point refuses it."""
    q, k, v = qkv(6, 6)
    said = rf"window_size must be odd .* got {even}, which would act as {even + 1}"
    with pytest.raises(ValueError, match=said):
        LocalAttention(even)
    with pytest.raises(ValueError, match=said):
        local_attention(q, k, v, window_size=even)
    with pytest.raises(ValueError, match=said):
        window_mask(6, 6, even)
    with pytest.raises(ValueError, match=said):
        WindowKVCache(even)
    with pytest.raises(ValueError, match=said):
        CausalLMConfig(vocab_size=10, max_len=8, d_model=8, num_heads=2, num_layers=1, d_ff=8,
                       attention="local", window_size=even)
    # the odd neighbour it would have acted as is accepted and is what the pattern shows
    assert window_mask(6, 6, even + 1)[0].sum() == min(6, even // 2 + 1)


def test_memory_is_linear_in_length():
    """Nothing L x L is built without weights: the largest tensor autograd keeps is a tile."""
    q, k, v = qkv(2048, 2048, batch=(1,), D=8, dtype=torch.float32, requires_grad=True)
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        local_attention(q, k, v, window_size=33)
    # the largest is one group of score tiles; all of them together are far below L x L
    assert max(sizes) <= 2 * 128 * (128 + 33)
    assert sum(sizes) < 2048 * 2048 // 4
