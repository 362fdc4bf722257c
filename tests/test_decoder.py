"""DecoderLayer / Decoder behaviour beyond torch parity: decoder-only form, attention kinds."""

from __future__ import annotations

import pytest
import torch

import handformer as hf

E, H, FF = 16, 2, 32


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_only_layer_equals_a_causal_encoder_layer(norm_first: bool) -> None:
    enc = hf.EncoderLayer(E, H, FF, dropout=0.0, norm_first=norm_first, activation="gelu")
    dec = hf.DecoderLayer(E, H, FF, dropout=0.0, norm_first=norm_first, activation="gelu",
                          cross_attention=False)
    assert set(dec.state_dict()) == set(enc.state_dict())  # one name per part: ln2 in both
    dec.load_state_dict(enc.state_dict(), strict=True)
    x = torch.randn(2, 9, E)
    torch.testing.assert_close(dec(x), enc(x, causal=True), atol=1e-6, rtol=1e-6)
    assert not hasattr(dec, "ln_cross") and dec.cross_attn is None


@pytest.mark.parametrize("attention", [hf.FullAttention(), hf.LocalAttention(3),
                                       hf.StridedAttention(2), hf.LinearAttention()])
def test_decoder_self_attention_kinds(attention: hf.AttentionKind) -> None:
    layer = hf.DecoderLayer(E, H, FF, dropout=0.1, attention=attention).eval()
    x, memory = torch.randn(2, 7, E), torch.randn(2, 5, E)
    out, self_w, cross_w = layer.forward_with_weights(x, memory)
    assert out.shape == (2, 7, E) and self_w.shape == (2, H, 7, 7)
    assert torch.all(self_w.triu(1) == 0)  # causal for every kind
    pattern = attention.pattern(7, 7, causal=True)
    assert torch.all(self_w[..., ~pattern] == 0)
    assert layer.attn.dropout == (0.1 if attention.supports_dropout else 0.0)
    assert layer.cross_attn.dropout == 0.1  # cross-attention is always full softmax


def test_decoder_stack_weights_and_final_norm() -> None:
    decoder = hf.Decoder(hf.DecoderLayer(E, H, FF, dropout=0.0), 3, final_norm=True)
    x, memory = torch.randn(2, 4, E), torch.randn(2, 6, E)
    keep = torch.tensor([True] * 4 + [False] * 2)[None, None, None, :]  # (1, 1, 1, S)
    out = decoder(x, memory, memory_mask=keep, need_weights=True)
    assert len(out.self_attentions) == 3 and out.cross_attentions[2].shape == (2, H, 4, 6)
    assert out.cross_attentions[0][..., 4:].abs().max() == 0
    h = x
    for layer in decoder.blocks:
        h = layer(h, memory, memory_mask=keep)
    torch.testing.assert_close(out.last_hidden_state, decoder.ln_final(h))
    assert decoder(x, memory).self_attentions is None
    with pytest.raises(ValueError, match="num_layers must be a positive integer"):
        hf.Decoder(hf.DecoderLayer(E, H, FF), 0)
