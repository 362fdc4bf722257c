"""scaled_dot_product_attention against a float64 math reference and torch's fused function."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from handformer import scaled_dot_product_attention as sdpa
from variant_reference import softmax_reference


def reference(q, k, v, allowed=None, bias=None, scale=None):
    """Independent float64 reference (empty rows -> 0), shared with the variants' tests."""
    return softmax_reference(q, k, v, allowed=allowed, bias=bias, scale=scale)


def bottom_right(L_q, L_k):
    i = torch.arange(L_q)[:, None]
    j = torch.arange(L_k)[None, :]
    return j <= i + L_k - L_q


SHAPES = [((3, 7, 8), (3, 5, 8), (3, 5, 6)), ((2, 3, 6, 16), (2, 3, 9, 16), (2, 3, 9, 4))]


@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("need_weights", [False, True])
def test_unmasked_matches_reference_and_torch(shapes, need_weights):
    q, k, v = (torch.randn(s) for s in shapes)
    out, w = sdpa(q, k, v, need_weights=need_weights)
    ref_out, ref_w = reference(q, k, v)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=1e-5,
                               rtol=1e-5)
    if need_weights:
        assert w.shape == (*q.shape[:-1], k.shape[-2])
        torch.testing.assert_close(w.double(), ref_w, atol=1e-5, rtol=1e-5)
    else:
        assert w is None


@pytest.mark.parametrize("mask_rank", [2, 3, 4])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_masks_of_every_rank(mask_rank, kind, need_weights):
    B, H, L_q, L_k, D = 2, 3, 5, 7, 8
    q, k, v = torch.randn(B, H, L_q, D), torch.randn(B, H, L_k, D), torch.randn(B, H, L_k, D)
    shape = {2: (L_q, L_k), 3: (H, L_q, L_k), 4: (B, 1, L_q, L_k)}[mask_rank]
    allowed = torch.rand(shape) > 0.3
    allowed[..., 0] = True  # keep rows non-empty so torch's own function is a fair reference
    if kind == "bool":
        mask, ref = allowed, reference(q, k, v, allowed=allowed)
    else:
        mask = torch.randn(shape)
        ref = reference(q, k, v, bias=mask)
    out, w = sdpa(q, k, v, mask, need_weights=need_weights)
    torch.testing.assert_close(out.double(), ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                               atol=1e-5, rtol=1e-5)
    if need_weights:
        torch.testing.assert_close(w.double(), ref[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("L_q,L_k", [(4, 4), (3, 8), (6, 6), (1, 9)])
@pytest.mark.parametrize("need_weights", [False, True])
def test_causal_bottom_right_combined_with_mask(L_q, L_k, need_weights):
    q, k, v = torch.randn(2, L_q, 8), torch.randn(2, L_k, 8), torch.randn(2, L_k, 8)
    pad = torch.ones(2, 1, L_k, dtype=torch.bool)
    pad[1, :, -2:] = False
    out, _ = sdpa(q, k, v, pad, causal=True, need_weights=need_weights)
    allowed = pad & bottom_right(L_q, L_k)
    torch.testing.assert_close(out.double(), reference(q, k, v, allowed=allowed)[0], atol=1e-5,
                               rtol=1e-5)
    causal_only, _ = sdpa(q, k, v, causal=True, need_weights=need_weights)
    torch.testing.assert_close(causal_only.double(),
                               reference(q, k, v, allowed=bottom_right(L_q, L_k))[0],
                               atol=1e-5, rtol=1e-5)


def test_causal_with_float_bias():
    q, k, v = torch.randn(4, 6, 8), torch.randn(4, 6, 8), torch.randn(4, 6, 8)
    bias = torch.randn(6, 6)
    out, w = sdpa(q, k, v, bias, causal=True, need_weights=True)
    ref_out, ref_w = reference(q, k, v, allowed=bottom_right(6, 6), bias=bias)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.double(), ref_w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("need_weights", [False, True])
def test_scale(need_weights):
    q, k, v = torch.randn(2, 5, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    out, _ = sdpa(q, k, v, scale=0.3, need_weights=need_weights)
    torch.testing.assert_close(out.double(), reference(q, k, v, scale=0.3)[0], atol=1e-5,
                               rtol=1e-5)


def test_dropout_with_fixed_seed_matches_torch():
    q, k, v = torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    torch.manual_seed(123)
    out, w = sdpa(q, k, v, dropout_p=0.4, need_weights=True)
    torch.manual_seed(123)
    expected = F.scaled_dot_product_attention(q, k, v, dropout_p=0.4)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # the returned weights are the distribution before dropout: rows sum to 1
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 6))
    # and dropout really changed the output
    assert not torch.allclose(out, sdpa(q, k, v)[0], atol=1e-3)


def test_fused_and_math_paths_agree():
    q, k, v = torch.randn(2, 4, 33, 16), torch.randn(2, 4, 40, 16), torch.randn(2, 4, 40, 16)
    mask = torch.rand(2, 1, 33, 40) > 0.5
    for causal in (False, True):
        fused, _ = sdpa(q, k, v, mask, causal=causal)
        math_path, _ = sdpa(q, k, v, mask, causal=causal, need_weights=True)
        torch.testing.assert_close(fused, math_path, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("kind", ["bool", "float", "causal"])
def test_fully_masked_rows_are_zero_with_zero_grads(dtype, need_weights, kind):
    q = torch.randn(2, 3, 5, 8, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 3, 6, 8, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 3, 6, 8, dtype=dtype, requires_grad=True)
    allowed = torch.rand(2, 1, 5, 6) > 0.5
    allowed[:, :, 1] = False  # row 1 attends nothing
    allowed[:, :, 2] = True
    causal = False
    if kind == "bool":
        mask = allowed
    elif kind == "float":
        mask = torch.zeros(2, 1, 5, 6).masked_fill(~allowed, float("-inf"))
    else:  # causal with L_q > L_k: the first rows see no key
        q = torch.randn(2, 3, 8, 8, dtype=dtype, requires_grad=True)
        mask, causal = None, True
    out, w = sdpa(q, k, v, mask, causal=causal, need_weights=need_weights)
    out.float().pow(2).sum().backward()
    empty_rows = [1] if kind != "causal" else [0, 1]
    for t in (out, q.grad, k.grad, v.grad):
        assert torch.isfinite(t).all()
    for r in empty_rows:
        assert (out[:, :, r] == 0).all()
        assert (q.grad[:, :, r] == 0).all()
        if need_weights:
            assert (w[:, :, r] == 0).all()
    assert (out[:, :, 2] != 0).any()


@pytest.mark.parametrize("need_weights", [False, True])
def test_masked_keys_do_not_matter(need_weights):
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 8)
    pad = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    pad[0, ..., 5:] = False
    pad[1, ..., 2:4] = False
    out, _ = sdpa(q, k, v, pad, need_weights=need_weights)
    k2, v2 = k.clone(), v.clone()
    blocked = ~pad.expand(2, 4, 1, 7).squeeze(2)  # (B, H, L_k)
    k2[blocked] = 1e10
    v2[blocked] = 1e10
    out2, _ = sdpa(q, k2, v2, pad, need_weights=need_weights)
    torch.testing.assert_close(out, out2, atol=0, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
def test_gradcheck_float64(causal, need_weights):
    q = torch.randn(2, 4, 6, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, 4, 5) > 0.3
    mask[:, 3] = False  # an empty row (its gradient must be zero, not NaN)

    def f(q, k, v):
        return sdpa(q, k, v, mask, causal=causal, need_weights=need_weights)[0]

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_gradients_match_reference():
    q = torch.randn(2, 2, 5, 8, requires_grad=True)
    k = torch.randn(2, 2, 7, 8, requires_grad=True)
    v = torch.randn(2, 2, 7, 8, requires_grad=True)
    mask = torch.rand(2, 1, 5, 7) > 0.4
    mask[..., 0] = True
    g = torch.randn(2, 2, 5, 8)
    grads = torch.autograd.grad(sdpa(q, k, v, mask, causal=True)[0], (q, k, v), g)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference(qd, kd, vd, allowed=mask & bottom_right(5, 7))[0]
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), g.double())
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)
