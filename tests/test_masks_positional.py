"""Mask builders/converters and positional encodings against their definitions."""

from __future__ import annotations

import math

import torch
from torch import nn

import handformer as hf
from handformer import masks


def test_causal_mask_bottom_right():
    m = masks.causal_mask(2, 4)
    expected = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(m, expected)
    assert torch.equal(masks.causal_mask(3), torch.ones(3, 3, dtype=torch.bool).tril())


def test_padding_mask_from_lengths_and_hf_mask_agree():
    from_lengths = masks.padding_mask(torch.tensor([3, 1]), max_len=4)
    hf_mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert from_lengths.shape == (2, 1, 1, 4)
    assert torch.equal(from_lengths, masks.from_hf_attention_mask(hf_mask))
    assert torch.equal(from_lengths[:, 0, 0], hf_mask.bool())


def test_from_torch_mask_inverts_booleans_only():
    blocked = torch.tensor([[False, True]])
    assert torch.equal(masks.from_torch_mask(blocked), ~blocked)
    bias = torch.tensor([[0.0, -1.0]])
    assert masks.from_torch_mask(bias) is bias


def test_converted_torch_mask_gives_torch_result():
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    ours = hf.interop.from_torch(mha)
    x = torch.randn(1, 4, 8)
    attn_mask = torch.rand(4, 4) > 0.6
    attn_mask.fill_diagonal_(False)  # torch: True = blocked; keep each row non-empty
    ref = mha(x, x, x, attn_mask=attn_mask)[0]
    torch.testing.assert_close(ours(x, mask=masks.from_torch_mask(attn_mask))[0], ref,
                               atol=1e-5, rtol=1e-5)


def test_window_and_strided_patterns_by_definition():
    w = masks.window_mask(5, 7, 3)
    s = masks.strided_mask(5, 7, 3, global_tokens=1, causal=True)
    for i in range(5):
        p = i + 2
        for j in range(7):
            assert bool(w[i, j]) == (abs(p - j) <= 1)
            ok = abs(p - j) < 3 or (p - j) % 3 == 0 or p < 1 or j < 1
            assert bool(s[i, j]) == (ok and j <= p)


def test_sinusoidal_matches_formula():
    E = 7  # odd on purpose
    pe = hf.SinusoidalPositionalEncoding(E, max_len=50)
    out = pe(torch.zeros(1, 50, E))[0]
    for pos in (0, 1, 17, 49):
        for i in range(E):
            angle = pos / 10000 ** ((i - i % 2) / E)
            expected = math.sin(angle) if i % 2 == 0 else math.cos(angle)
            assert abs(out[pos, i].item() - expected) < 1e-6
    shifted = pe(torch.zeros(1, 3, E), offset=17)[0]
    torch.testing.assert_close(shifted, out[17:20])


def test_learned_positional_adds_rows():
    pe = hf.LearnedPositionalEmbedding(10, 4)
    x = torch.randn(2, 3, 4)
    torch.testing.assert_close(pe(x, offset=2), x + pe.weight[2:5])
    assert pe.weight.requires_grad
