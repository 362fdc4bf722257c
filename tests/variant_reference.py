"""Dense float64 references for the efficient attention variants (test helper).

Independent of the library's attention code: the pattern is an explicit boolean matrix
(built by handformer.masks' dense builders), the softmax / kernel sums are written out.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def softmax_reference(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None = None,
                      bias: Tensor | None = None, scale: float | None = None
                      ) -> tuple[Tensor, Tensor]:
    """softmax(q k^T * scale + bias) v over ``allowed`` in float64; empty rows -> 0.

    ``scale`` defaults to ``1 / sqrt(D)``; ``allowed`` None means every key.
    """
    q, k, v = q.double(), k.double(), v.double()
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.transpose(-2, -1) * scale
    if bias is not None:
        s = s + bias.double()
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    den = e.sum(-1, keepdim=True)
    w = torch.where(den > 0, e / den.clamp_min(1e-300), torch.zeros_like(e))
    return w @ v, w


def elu1(x: Tensor) -> Tensor:
    return F.elu(x) + 1


def kernel_reference(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None = None,
                     key_weight: Tensor | None = None, phi=elu1, eps: float = 1e-6,
                     key_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """sum_j phi(q_i).phi(k_j) v_j / (sum_j phi(q_i).phi(k_j) + eps) in float64.

    ``key_bias`` (broadcastable to ``(..., L_q, L_k)``) weights key ``j`` for query ``i`` by
    ``exp(b_j - m_i)``, ``m_i`` the largest bias among the keys ``i`` may attend (as softmax
    treats an additive bias); written out densely, row by row.
    """
    q, k, v = q.double(), k.double(), v.double()
    K = phi(q) @ phi(k).transpose(-2, -1)  # (..., L_q, L_k)
    if key_weight is not None:
        K = K * key_weight.double()
    if key_bias is not None:
        b = key_bias.double().expand(*K.shape[:-2], *K.shape[-2:])  # (..., L_q, L_k)
        if allowed is not None:
            b = b.masked_fill(~allowed, float("-inf"))
        m = b.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        K = K * torch.exp(b - m)
    if allowed is not None:
        K = K * allowed
    W = K / (K.sum(-1, keepdim=True) + eps)
    return W @ v, W


def qkv(L_q: int, L_k: int, *, batch=(2, 3), D: int = 8, D_v: int = 5,
        dtype=torch.float64, requires_grad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    q = torch.randn(*batch, L_q, D, dtype=dtype)
    k = torch.randn(*batch, L_k, D, dtype=dtype)
    v = torch.randn(*batch, L_k, D_v, dtype=dtype)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def padding_keep(lengths: list[int], L_k: int) -> Tensor:
    """(B, 1, 1, L_k) bool key mask, True for the first ``lengths[b]`` keys."""
    return (torch.arange(L_k) < torch.tensor(lengths)[:, None]).reshape(len(lengths), 1, 1, L_k)


def compare(fn, ref_fn, L_q: int, L_k: int, dtype, *, mask=None, check_grads: bool = True
            ) -> None:
    """Assert ``fn(q, k, v) -> (out, weights)`` equals ``ref_fn`` in value, weights and grads.

    Tolerance: 1e-5 for float32, 1e-10 for float64 (absolute, against a float64 reference
    evaluated on the same inputs).
    """
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    q, k, v = qkv(L_q, L_k, dtype=dtype, requires_grad=True)
    out, weights = fn(q, k, v, mask=mask, need_weights=True)
    qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref_out, ref_w = ref_fn(qd, kd, vd)
    assert out.dtype == dtype and out.shape == ref_out.shape
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=0)
    torch.testing.assert_close(weights.double(), ref_w, atol=tol, rtol=0)
    # out @ v reproduces the output from the returned weights
    torch.testing.assert_close((weights.double() @ vd).detach(), ref_out.detach(), atol=tol,
                               rtol=0)
    if check_grads:
        fast_out, _ = fn(q, k, v, mask=mask, need_weights=False)
        torch.testing.assert_close(fast_out.double(), ref_out, atol=tol, rtol=0)
        g = torch.randn_like(ref_out)
        fast_out.backward(g.to(dtype))
        ref_out.backward(g)
        for name, a, b in (("q", q, qd), ("k", k, kd), ("v", v, vd)):
            assert not torch.isnan(a.grad).any(), name
            torch.testing.assert_close(a.grad.double(), b.grad, atol=tol, rtol=0, msg=name)
