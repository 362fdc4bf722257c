"""DecoderLayer / Decoder / Transformer converted from torch.nn: same outputs and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import handformer as hf
from handformer.interop import from_torch, to_torch
from handformer.masks import from_torch_mask

B, L, S, E, H, FF = 3, 6, 7, 16, 4, 24


def grads_in_torch_layout(ours: nn.Module) -> dict[str, torch.Tensor]:
    """Our gradients, converted to torch's parameter names and layout via ``to_torch``."""
    clone = copy.deepcopy(ours)
    with torch.no_grad():
        for p, c in zip(ours.parameters(), clone.parameters(), strict=True):
            c.copy_(p.grad)
    return dict(to_torch(clone).named_parameters())


def assert_same_grads(ours: nn.Module, theirs: nn.Module) -> None:
    converted = grads_in_torch_layout(ours)
    for name, p in theirs.named_parameters():
        torch.testing.assert_close(converted[name], p.grad, atol=1e-5, rtol=1e-5, msg=name)


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    tgt = torch.randn(B, L, E, requires_grad=True)
    memory = torch.randn(B, S, E, requires_grad=True)
    causal = nn.Transformer.generate_square_subsequent_mask(L)  # float, -inf above diagonal
    pad = torch.arange(S)[None, :] >= torch.tensor([S, S - 2, 3])[:, None]  # True = blocked
    return tgt, memory, causal, pad


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_decoder_layer_from_torch(norm_first: bool, activation: str) -> None:
    theirs = nn.TransformerDecoderLayer(E, H, FF, dropout=0.0, activation=activation,
                                        batch_first=True, norm_first=norm_first)
    ours = from_torch(theirs)
    assert isinstance(ours, hf.DecoderLayer)
    tgt, memory, causal, pad = inputs()
    expected = theirs(tgt, memory, tgt_mask=causal, memory_key_padding_mask=pad)
    t2, m2 = tgt.detach().clone().requires_grad_(), memory.detach().clone().requires_grad_()
    got = ours(t2, m2, memory_mask=from_torch_mask(pad)[:, None, None, :])  # causal default
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    upstream = torch.randn_like(got)
    (expected * upstream).sum().backward()
    (got * upstream).sum().backward()
    torch.testing.assert_close(t2.grad, tgt.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m2.grad, memory.grad, atol=1e-5, rtol=1e-5)
    assert_same_grads(ours, theirs)


def test_decoder_layer_weights_and_to_torch_round_trip() -> None:
    ours = hf.DecoderLayer(E, H, FF, dropout=0.0, activation="gelu_tanh", norm_first=True)
    theirs = to_torch(ours)
    assert isinstance(theirs, nn.TransformerDecoderLayer) and theirs.norm_first
    tgt, memory, causal, _ = inputs()
    expected = theirs(tgt, memory, tgt_mask=causal)
    got, self_w, cross_w = ours.forward_with_weights(tgt, memory)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert self_w.shape == (B, H, L, L) and cross_w.shape == (B, H, L, S)
    assert torch.all(self_w.triu(1) == 0)  # causal: nothing above the diagonal
    torch.testing.assert_close(cross_w.sum(-1), torch.ones(B, H, L))


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_from_torch_outputs_and_grads(norm_first: bool) -> None:
    theirs = nn.Transformer(E, H, 2, 3, FF, dropout=0.0, batch_first=True,
                            norm_first=norm_first, activation="gelu")
    ours = from_torch(theirs)
    assert isinstance(ours, hf.Transformer)
    assert len(ours.encoder.blocks) == 2 and len(ours.decoder.blocks) == 3
    tgt, src, causal, pad = inputs()
    expected = theirs(src, tgt, tgt_mask=causal, src_key_padding_mask=pad,
                      memory_key_padding_mask=pad)
    keep = from_torch_mask(pad)[:, None, None, :]  # (B, 1, 1, S)
    out = ours(src, tgt, src_mask=keep, memory_mask=keep, need_weights=True)
    torch.testing.assert_close(out.last_hidden_state, expected, atol=1e-5, rtol=1e-5)
    assert len(out.encoder_attentions) == 2 and len(out.decoder_cross_attentions) == 3
    assert out.decoder_cross_attentions[0][2, :, :, 3:].abs().max() == 0  # padding unseen
    upstream = torch.randn_like(expected)
    (expected * upstream).sum().backward()
    (out.last_hidden_state * upstream).sum().backward()
    assert_same_grads(ours, theirs)


def test_transformer_to_torch_and_decoder_stack() -> None:
    ours = hf.Transformer(E, H, 1, 2, FF, dropout=0.0).eval()
    theirs = to_torch(ours)
    assert isinstance(theirs, nn.Transformer) and not theirs.training
    tgt, src, causal, _ = inputs()
    torch.testing.assert_close(ours(src, tgt).last_hidden_state,
                               theirs(src, tgt, tgt_mask=causal), atol=1e-5, rtol=1e-5)
    decoder = to_torch(ours.decoder)
    assert isinstance(decoder, nn.TransformerDecoder)
    back = from_torch(decoder)
    assert isinstance(back, hf.Decoder)
    torch.testing.assert_close(back(tgt, src).last_hidden_state,
                               decoder(tgt, src, tgt_mask=causal), atol=1e-5, rtol=1e-5)


def test_conversion_errors() -> None:
    with pytest.raises(ValueError, match="always has cross-attention"):
        to_torch(hf.DecoderLayer(E, H, FF, cross_attention=False))
    with pytest.raises(ValueError, match="no rotary embedding"):
        to_torch(hf.MultiHeadAttention(E, H, rotary=hf.RotaryEmbedding(E // H)))


def test_decoder_layer_memory_errors() -> None:
    with pytest.raises(ValueError, match="has cross-attention: pass memory"):
        hf.DecoderLayer(E, H, FF)(torch.randn(1, 2, E))
    with pytest.raises(ValueError, match="no cross-attention"):
        hf.DecoderLayer(E, H, FF, cross_attention=False)(torch.randn(1, 2, E),
                                                         torch.randn(1, 2, E))
    with pytest.raises(ValueError, match="must share B"):
        hf.Transformer(E, H, 1, 1, FF)(torch.randn(2, 3, E), torch.randn(1, 3, E))
