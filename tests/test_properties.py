"""Property-based tests (hypothesis): every attention kind against its float64 reference.

Random batch/heads/lengths/head dims (length 1 and L_q != L_k included), random boolean masks
with empty rows, causal or not. Invariants: masked keys do not change the output; permuting
unmasked keys (with their values) does not change full attention; rows of the returned weights
sum to 1 or are all zero. Each property runs 200 examples.
"""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import handformer as hf
from handformer import masks

EXAMPLES = settings(max_examples=200, deadline=None, derandomize=True)

# Random masks are sometimes all False on purpose (every row empty -> zeros); the library's
# "did you pass a torch True = blocked mask?" warning is expected there.
pytestmark = pytest.mark.filterwarnings("ignore:mask is a boolean mask with no True entry")


@dataclass
class Case:
    kind: str
    B: int
    H: int
    L_q: int
    L_k: int
    D: int
    causal: bool
    param: int
    seed: int
    key_mask: bool

    @property
    def window(self) -> int:
        """The local window: ``param`` made odd (local attention refuses even windows)."""
        return self.param | 1


KIND_NAMES = ["full", "local", "strided", "linear"]


@st.composite
def cases(draw, kinds=tuple(KIND_NAMES)):
    return Case(
        kind=draw(st.sampled_from(kinds)),
        B=draw(st.integers(1, 2)), H=draw(st.integers(1, 3)),
        L_q=draw(st.integers(1, 13)), L_k=draw(st.integers(1, 13)), D=draw(st.integers(1, 8)),
        causal=draw(st.booleans()), param=draw(st.integers(1, 15)),
        seed=draw(st.integers(0, 2**31 - 1)), key_mask=draw(st.booleans()),
    )


def make_kind(c: Case) -> hf.AttentionKind:
    return {
        "full": lambda: hf.FullAttention(),
        "local": lambda: hf.LocalAttention(c.window),
        "strided": lambda: hf.StridedAttention(c.param, global_tokens=c.param % 3),
        "linear": lambda: hf.LinearAttention(),
    }[c.kind]()


def pattern(c: Case) -> torch.Tensor:
    """The kind's allowed (L_q, L_k) pattern, built from its definition."""
    if c.kind == "local":
        return masks.window_mask(c.L_q, c.L_k, c.window, causal=c.causal)
    if c.kind == "strided":
        return masks.strided_mask(c.L_q, c.L_k, c.param, global_tokens=c.param % 3,
                                  causal=c.causal)
    if c.causal:
        return masks.causal_mask(c.L_q, c.L_k)
    return torch.ones(c.L_q, c.L_k, dtype=torch.bool)


def inputs(c: Case, dtype=torch.float32):
    g = torch.Generator().manual_seed(c.seed)
    q = torch.randn(c.B, c.H, c.L_q, c.D, generator=g, dtype=dtype)
    k = torch.randn(c.B, c.H, c.L_k, c.D, generator=g, dtype=dtype)
    v = torch.randn(c.B, c.H, c.L_k, c.D, generator=g, dtype=dtype)
    if c.key_mask or c.kind == "linear":  # linear attention takes key masks only
        mask = torch.rand(c.B, 1, 1, c.L_k, generator=g) > 0.3
    else:
        mask = torch.rand(c.B, 1, c.L_q, c.L_k, generator=g) > 0.4
    return q, k, v, mask


def reference(c: Case, q, k, v, mask):
    """Dense float64 reference: softmax (or elu+1 kernel) over the allowed keys; empty -> 0."""
    q, k, v = q.double(), k.double(), v.double()
    allowed = mask & pattern(c)  # (B, H|1, L_q, L_k)
    if c.kind == "linear":
        phi_q = torch.nn.functional.elu(q) + 1
        phi_k = torch.nn.functional.elu(k) + 1
        s = (phi_q @ phi_k.transpose(-2, -1)) * allowed
        w = s / (s.sum(-1, keepdim=True) + 1e-6)
        return w @ v, w
    s = (q @ k.transpose(-2, -1)) / c.D ** 0.5
    s = s.masked_fill(~allowed, float("-inf"))
    w = torch.softmax(s, -1).nan_to_num(0.0)
    return w @ v, w


@EXAMPLES
@given(cases())
def test_every_kind_matches_float64_reference(c):
    q, k, v, mask = inputs(c)
    out, w = make_kind(c)(q, k, v, causal=c.causal, mask=mask, need_weights=True)
    ref_out, ref_w = reference(c, q, k, v, mask)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.double(), ref_w, atol=1e-5, rtol=1e-5)
    fast, none = make_kind(c)(q, k, v, causal=c.causal, mask=mask)
    assert none is None
    torch.testing.assert_close(fast.double(), ref_out, atol=1e-5, rtol=1e-5)


@EXAMPLES
@given(cases())
def test_masked_keys_do_not_change_the_output(c):
    q, k, v, _ = inputs(c)
    g = torch.Generator().manual_seed(c.seed + 1)
    key_mask = torch.rand(c.B, 1, 1, c.L_k, generator=g) > 0.5  # (B, 1, 1, L_k)
    kind = make_kind(c)
    out = kind(q, k, v, causal=c.causal, mask=key_mask)[0]
    blocked = ~key_mask.transpose(-2, -1)  # (B, 1, L_k, 1), broadcasts over heads and D
    k2 = torch.where(blocked, 1e4 * torch.randn_like(k), k)
    v2 = torch.where(blocked, 1e4 * torch.randn_like(v), v)
    out2 = kind(q, k2, v2, causal=c.causal, mask=key_mask)[0]
    torch.testing.assert_close(out, out2, atol=1e-5, rtol=1e-5)


@EXAMPLES
@given(cases(kinds=("full",)), st.randoms(use_true_random=False))
def test_permuting_keys_does_not_change_full_attention(c, rnd):
    q, k, v, _ = inputs(c)
    mask = torch.rand(c.B, 1, c.L_q, c.L_k) > 0.3
    perm = list(range(c.L_k))
    rnd.shuffle(perm)
    perm = torch.tensor(perm)
    out = hf.FullAttention()(q, k, v, mask=mask)[0]
    permuted = hf.FullAttention()(q, k[..., perm, :], v[..., perm, :], mask=mask[..., perm])[0]
    torch.testing.assert_close(out, permuted, atol=1e-5, rtol=1e-5)


@EXAMPLES
@given(cases(kinds=("full", "local", "strided")))
def test_weight_rows_sum_to_one_or_zero(c):
    q, k, v, mask = inputs(c)
    _, w = make_kind(c)(q, k, v, causal=c.causal, mask=mask, need_weights=True)
    sums = w.sum(-1)
    assert torch.all(((sums - 1).abs() < 1e-5) | (sums == 0))
    assert torch.all((w == 0) | (mask & pattern(c)))
