"""MultiHeadAttention / EncoderLayer converted from torch.nn give the same outputs and grads."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import handformer as hf
from handformer.interop import from_torch, to_torch
from handformer.masks import causal_mask, from_torch_mask, padding_mask

B, L, E, H = 3, 7, 32, 4


def torch_padding(lengths, L):
    """torch's key_padding_mask: (B, L) True = blocked."""
    return torch.arange(L)[None, :] >= torch.tensor(lengths)[:, None]


def assert_grads_match(ours: nn.Module, theirs: nn.Module) -> None:
    """Every parameter gradient of ``ours`` equals the corresponding one of ``theirs``.

    Our gradients are copied into a module of our layout and converted with ``to_torch``, so
    they are compared name by name in torch's layout (packed in_proj etc.).
    """
    theirs_grads = {n: p.grad for n, p in theirs.named_parameters()}
    for name, g in to_torch(_grads_as_module(ours)).named_parameters():
        torch.testing.assert_close(g, theirs_grads[name], atol=1e-5, rtol=1e-5, msg=name)


def _grads_as_module(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters hold its gradients (to convert the layout)."""
    clone = copy.deepcopy(module)
    with torch.no_grad():
        for p, c in zip(module.parameters(), clone.parameters(), strict=True):
            c.copy_(p.grad)
    return clone


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("masking", ["none", "padding", "causal", "both"])
def test_mha_matches_torch(batch_first, bias, masking):
    theirs = nn.MultiheadAttention(E, H, bias=bias, batch_first=batch_first)
    ours = from_torch(theirs)
    x = torch.randn(B, L, E)
    lengths = [7, 5, 2]
    kpm = torch_padding(lengths, L) if masking in ("padding", "both") else None
    attn_mask = torch.triu(torch.ones(L, L, dtype=torch.bool), 1) if masking in (
        "causal", "both") else None
    x_t = x if batch_first else x.transpose(0, 1)  # (L, B, E) for batch_first=False
    x_t = x_t.clone().requires_grad_()
    ref, ref_w = theirs(x_t, x_t, x_t, key_padding_mask=kpm, attn_mask=attn_mask,
                        need_weights=True, average_attn_weights=False)
    if not batch_first:
        ref = ref.transpose(0, 1)
    mask = padding_mask(torch.tensor(lengths), L) if kpm is not None else None
    x_o = x.clone().requires_grad_()
    out, w = ours(x_o, mask=mask, causal=attn_mask is not None, need_weights=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w, ref_w, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    x_grad_ref = x_t.grad if batch_first else x_t.grad.transpose(0, 1)
    torch.testing.assert_close(x_o.grad, x_grad_ref, atol=1e-5, rtol=1e-5)
    assert_grads_match(ours, theirs)


def test_mha_cross_attention_with_kdim_vdim_and_round_trip():
    theirs = nn.MultiheadAttention(E, H, kdim=12, vdim=20, batch_first=True)
    ours = from_torch(theirs)
    q, k, v = torch.randn(B, 5, E), torch.randn(B, 9, 12), torch.randn(B, 9, 20)
    ref, ref_w = theirs(q, k, v, average_attn_weights=False)
    out, w = ours(q, k, v, need_weights=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w, ref_w, atol=1e-5, rtol=1e-5)
    back = to_torch(ours)
    torch.testing.assert_close(back(q, k, v)[0], ref, atol=1e-6, rtol=1e-6)


def test_torch_float_mask_converts_unchanged():
    theirs = nn.MultiheadAttention(E, H, batch_first=True)
    ours = from_torch(theirs)
    x = torch.randn(B, L, E)
    bias = torch.randn(L, L)
    ref = theirs(x, x, x, attn_mask=bias)[0]
    torch.testing.assert_close(ours(x, mask=from_torch_mask(bias))[0], ref, atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_encoder_layer_matches_torch(norm_first, activation, mode):
    dropout = 0.1 if mode == "eval" else 0.0
    theirs = nn.TransformerEncoderLayer(E, H, 64, dropout=dropout, activation=activation,
                                        batch_first=True, norm_first=norm_first)
    theirs.train(mode == "train")
    ours = from_torch(theirs)
    assert ours.training == (mode == "train")
    x = torch.randn(B, L, E)
    lengths = [7, 4, 6]
    kpm = torch_padding(lengths, L)
    x_t = x.clone().requires_grad_()
    x_o = x.clone().requires_grad_()
    ref = theirs(x_t, src_key_padding_mask=kpm)
    out = ours(x_o, padding_mask(torch.tensor(lengths), L))
    if mode == "eval":
        # torch's eval fast path returns zeros at padded positions (nested tensors); compare
        # the real tokens, which is what the layer defines
        keep = ~kpm
        torch.testing.assert_close(out[keep], ref[keep], atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    torch.testing.assert_close(x_o.grad, x_t.grad, atol=1e-5, rtol=1e-5)
    assert_grads_match(ours, theirs)


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_causal_matches_torch(norm_first):
    theirs = nn.TransformerEncoderLayer(E, H, 64, dropout=0.0, batch_first=True,
                                        norm_first=norm_first)
    ours = from_torch(theirs)
    x = torch.randn(B, L, E)
    ref = theirs(x, src_mask=~causal_mask(L), is_causal=True)
    torch.testing.assert_close(ours(x, causal=True), ref, atol=1e-5, rtol=1e-5)


def test_encoder_layer_round_trip_gelu_tanh():
    ours = hf.EncoderLayer(E, H, 64, activation="gelu_tanh", norm_first=True).eval()
    back = to_torch(ours).eval()
    x = torch.randn(B, L, E)
    torch.testing.assert_close(back(x), ours(x), atol=1e-5, rtol=1e-5)


def test_encoder_stack_matches_torch_encoder():
    layer = nn.TransformerEncoderLayer(E, H, 64, dropout=0.0, batch_first=True,
                                       norm_first=True)
    theirs = nn.TransformerEncoder(layer, 3, norm=nn.LayerNorm(E),
                                   enable_nested_tensor=False).eval()
    ours = hf.Encoder(lambda: hf.EncoderLayer(E, H, 64, dropout=0.0, norm_first=True), 3,
                      final_norm=True).eval()
    for ol, tl in zip(ours.blocks, theirs.layers, strict=True):
        ol.load_state_dict(from_torch(tl).state_dict())
    ours.ln_final.load_state_dict(theirs.norm.state_dict())
    x = torch.randn(B, L, E)
    res = ours(x, need_weights=True)
    torch.testing.assert_close(res.last_hidden_state, theirs(x), atol=1e-5, rtol=1e-5)
    assert len(res.attentions) == 3
    assert all(a.shape == (B, H, L, L) for a in res.attentions)
    torch.testing.assert_close(res.attentions[1].sum(-1), torch.ones(B, H, L))


def test_gradcheck_modules_float64():
    torch.manual_seed(1)
    mha = hf.MultiHeadAttention(8, 2).double()
    layer = hf.EncoderLayer(8, 2, 16, dropout=0.0).double()
    x = torch.randn(2, 4, 8, dtype=torch.float64, requires_grad=True)
    mask = padding_mask(torch.tensor([4, 2]), 4)
    assert torch.autograd.gradcheck(lambda t: mha(t, mask=mask, causal=True)[0], (x,))
    assert torch.autograd.gradcheck(lambda t: layer(t, mask), (x,))
