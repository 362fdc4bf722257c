"""Documented regression: the seed tutorial's section 7 variants, reproduced as written.

The seed (``shared/seed/000_f997310eb6b8e4be.txt``, "7. 扩展应用：自定义注意力变体") sketches
local, sparse and linear attention. The functions below are copied from it verbatim (only
reformatted onto several lines and renamed ``seed_*``), together with the seed's own
``scaled_dot_product_attention`` that they call. Each test shows that the seed function does
not compute the pattern it describes, and that handformer's version does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from handformer import linear_attention, local_attention, strided_attention
from handformer.masks import strided_mask, window_mask
from variant_reference import kernel_reference, softmax_reference


# ---- the seed's code, as written --------------------------------------------------------
def seed_scaled_dot_product_attention(q, k, v, mask=None):
    matmul_qk = torch.matmul(q, k.transpose(-2, -1))
    d_k = q.size()[-1]
    scaled_attention_logits = matmul_qk / math.sqrt(d_k)
    if mask is not None:
        scaled_attention_logits += (mask * -1e9)
    attention_weights = F.softmax(scaled_attention_logits, dim=-1)
    output = torch.matmul(attention_weights, v)
    return output, attention_weights


def seed_local_attention(q, k, v, window_size=3):
    # 只计算局部窗口内的注意力
    seq_len = q.size(-2)
    mask = torch.ones_like(q @ k.transpose(-2, -1))
    for i in range(seq_len):
        start = max(0, i - window_size // 2)
        end = min(seq_len, i + window_size // 2 + 1)
        mask[..., i, :start] = -1e9
        mask[..., i, end:] = -1e9
    return seed_scaled_dot_product_attention(q, k, v, mask)


def seed_sparse_attention(q, k, v, stride=2):
    # 每隔stride个token计算一次注意力
    seq_len = q.size(-2)
    mask = torch.zeros_like(q @ k.transpose(-2, -1))
    for i in range(0, seq_len, stride):
        mask[..., i, :] = 1
    mask = (1.0 - mask) * -1e9
    return seed_scaled_dot_product_attention(q, k, v, mask)


def seed_linear_attention(q, k, v):
    # 近似计算，复杂度O(n)而非O(n^2)
    kv = torch.einsum('nshd,nshm->nhmd', k, v)
    z = 1 / (torch.einsum('nlhd,nhd->nlh', q, k.sum(dim=1)) + 1e-6)
    return torch.einsum('nlhd,nhmd,nlh->nlhm', q, kv, z)
# -----------------------------------------------------------------------------------------


def test_seed_local_attention_looks_everywhere_except_its_window():
    L, w = 12, 3
    q, k, v = (torch.randn(1, 2, L, 8) for _ in range(3))
    window = window_mask(L, L, w)  # (L, L), True inside the window
    _, seed_w = seed_local_attention(q, k, v, window_size=w)
    # The window's keys get "+ 1 * -1e9" and the others "+ (-1e9) * -1e9 = +1e18": the
    # window receives no weight at all, and the rest shares it uniformly.
    assert seed_w.masked_select(window).abs().max() < 1e-6
    outside = (~window).sum(-1, keepdim=True)  # (L, 1)
    torch.testing.assert_close(seed_w, (~window) / outside * torch.ones_like(seed_w))
    # handformer: all weight inside the window, equal to the dense reference.
    out, ours = local_attention(q, k, v, window_size=w, need_weights=True)
    assert ours.masked_select(~window).abs().max() == 0
    torch.testing.assert_close(ours.sum(-1), torch.ones(1, 2, L))
    ref_out, _ = softmax_reference(q, k, v, window)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=0)


def test_seed_sparse_attention_follows_no_sparse_pattern():
    L, s = 12, 3
    q, k, v = (torch.randn(1, 2, L, 8) for _ in range(3))
    _, seed_w = seed_sparse_attention(q, k, v, stride=s)
    pattern = strided_mask(L, L, s)
    # Rows 0, s, 2s, ... get a zero bias: ordinary dense attention over every key.
    dense = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(8), dim=-1)
    marked = torch.arange(L) % s == 0
    torch.testing.assert_close(seed_w[..., marked, :], dense[..., marked, :])
    # Every other row gets +1e18 on every key: uniform weights, the scores are lost.
    torch.testing.assert_close(seed_w[..., ~marked, :],
                               torch.full_like(seed_w[..., ~marked, :], 1 / L))
    # So every row puts weight on keys outside the strided pattern it describes.
    assert (seed_w.masked_fill(pattern, 0).sum(-1) > 0.1).all()
    out, ours = strided_attention(q, k, v, stride=s, need_weights=True)
    assert ours.masked_select(~pattern).abs().max() == 0
    ref_out, _ = softmax_reference(q, k, v, pattern)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=0)


def test_seed_linear_attention_has_no_positive_feature_map():
    B, L, H, D = 1, 64, 2, 8
    q, k, v = (torch.randn(B, L, H, D, dtype=torch.float64) for _ in range(3))  # seed layout
    seed_out = seed_linear_attention(q, k, v)  # (B, L, H, D)
    # What it computes: kernel attention with phi(x) = x (no feature map) ...
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, L, D)
    identity_out, identity_w = kernel_reference(qh, kh, vh, phi=lambda x: x)
    torch.testing.assert_close(seed_out.transpose(1, 2), identity_out)
    # ... whose denominators q_i . sum_j k_j are negative for some rows: its "weights" are
    # not a distribution (negative entries) and outputs leave the range of the values.
    den = torch.einsum("nlhd,nhd->nlh", q, k.sum(dim=1))
    assert (den < 0).any()
    assert (identity_w < 0).any()
    assert seed_out.abs().max() > v.abs().max()
    # handformer: phi = elu + 1 > 0, so weights are non-negative and rows sum to ~1;
    # every output is a convex combination of the values.
    out, w = linear_attention(qh, kh, vh, need_weights=True)
    assert (w >= 0).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(B, H, L, dtype=torch.float64),
                               atol=1e-5, rtol=0)
    assert (out <= vh.amax(-2, keepdim=True) + 1e-12).all()
    assert (out >= vh.amin(-2, keepdim=True) - 1e-12).all()
