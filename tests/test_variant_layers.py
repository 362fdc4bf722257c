"""MultiHeadAttention / EncoderLayer with the efficient attention kinds."""

from __future__ import annotations

import pytest
import torch

from handformer import (
    EncoderLayer,
    LinearAttention,
    LocalAttention,
    MultiHeadAttention,
    StridedAttention,
)
from handformer.masks import causal_mask
from variant_reference import kernel_reference, padding_keep

SOFTMAX_KINDS = [LocalAttention(5), StridedAttention(4, global_tokens=1)]
ALL_KINDS = [*SOFTMAX_KINDS, LinearAttention()]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", SOFTMAX_KINDS, ids=repr)
def test_mha_with_kind_equals_full_attention_with_its_pattern(kind, causal):
    B, L, E, H = 2, 19, 16, 4
    x = torch.randn(B, L, E, dtype=torch.float64)
    keep = padding_keep([19, 11], L)  # (B, 1, 1, L)
    mha = MultiHeadAttention(E, H, attention=kind).double()
    full = MultiHeadAttention(E, H).double()
    full.load_state_dict(mha.state_dict())
    out, w = mha(x, mask=keep, causal=causal, need_weights=True)
    ref, ref_w = full(x, mask=keep & kind.pattern(L, L, causal=causal), need_weights=True)
    assert w.shape == (B, H, L, L)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(w, ref_w, atol=1e-10, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_mha_with_linear_attention_equals_kernel_reference(causal):
    B, L, E, H = 2, 19, 16, 4
    x = torch.randn(B, L, E, dtype=torch.float64)
    keep = padding_keep([19, 11], L)
    mha = MultiHeadAttention(E, H, attention=LinearAttention()).double()
    out, w = mha(x, mask=keep, causal=causal, need_weights=True)
    q, k, v = (mha.split_heads(p(x)) for p in (mha.q_proj, mha.k_proj, mha.v_proj))
    allowed = causal_mask(L, L) if causal else None
    heads, ref_w = kernel_reference(q, k, v, allowed, key_weight=keep)
    ref = mha.out_proj(mha.merge_heads(heads))
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(w, ref_w, atol=1e-10, rtol=0)


@pytest.mark.parametrize("kind", ALL_KINDS, ids=repr)
def test_encoder_layer_with_kind_trains_and_matches_in_eval(kind):
    torch.manual_seed(0)
    B, L, E = 2, 23, 16
    layer = EncoderLayer(E, 4, 32, dropout=0.1, attention=kind)  # residual dropouts only
    assert layer.attn.dropout == 0.0
    x = torch.randn(B, L, E, requires_grad=True)
    keep = padding_keep([23, 9], L)
    layer.train()
    layer(x, keep, causal=True).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())
    layer.eval()
    y, w = layer.forward_with_weights(x, keep, causal=True)
    assert w.shape == (B, 4, L, L) and torch.isfinite(y).all()
    if kind.pattern(L, L) is not None:  # softmax kinds: same as full attention + pattern mask
        full = EncoderLayer(E, 4, 32, dropout=0.1).eval()
        full.load_state_dict(layer.state_dict())
        ref = full(x, keep & kind.pattern(L, L, causal=True))
        torch.testing.assert_close(y, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ALL_KINDS, ids=repr)
def test_mha_dropout_with_kind_without_dropout_raises(kind):
    assert kind.supports_dropout is False
    with pytest.raises(ValueError, match="dropout"):
        MultiHeadAttention(16, 4, dropout=0.1, attention=kind)
