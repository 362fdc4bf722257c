"""RoPE and ALiBi against their formulas, computed independently in float64."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import handformer as hf
from handformer import positional_rotary
from handformer.positional_rotary import alibi_slopes


def rope_reference(x: torch.Tensor, positions: list[int], base: float = 10000.0
                   ) -> torch.Tensor:
    """Rotate pairs (i, i + D/2) by angle p * base^(-2i/D), element by element."""
    out = torch.empty_like(x, dtype=torch.float64)
    D = x.shape[-1]
    half = D // 2
    for t, p in enumerate(positions):
        for i in range(half):
            angle = p * base ** (-2 * i / D)
            a, b = x[..., t, i].double(), x[..., t, i + half].double()
            out[..., t, i] = a * math.cos(angle) - b * math.sin(angle)
            out[..., t, i + half] = b * math.cos(angle) + a * math.sin(angle)
    return out


@pytest.mark.parametrize("D, base", [(8, 10000.0), (6, 500.0)])
def test_rope_matches_formula(D: int, base: float) -> None:
    rope = hf.RotaryEmbedding(D, base=base)
    q, k = torch.randn(2, 3, 5, D, dtype=torch.float64), torch.randn(2, 3, 5, D)
    positions = [0, 1, 7, 100, 2047]
    rq, rk = rope(q, k, torch.tensor(positions))
    torch.testing.assert_close(rq, rope_reference(q, positions, base), atol=1e-12, rtol=0)
    assert rk.dtype == torch.float32
    torch.testing.assert_close(rk.double(), rope_reference(k, positions, base), atol=1e-5,
                               rtol=1e-5)


def test_rope_scores_depend_only_on_relative_position() -> None:
    rope = hf.RotaryEmbedding(16)
    q, k = torch.randn(1, 1, 1, 16, dtype=torch.float64), torch.randn(1, 1, 1, 16,
                                                                       dtype=torch.float64)

    def score(m: int, n: int) -> float:
        return float((rope.rotate(q, torch.tensor([m])) * rope.rotate(k, torch.tensor([n])))
                     .sum())

    for m, n in [(3, 1), (10, 4), (0, 5)]:
        assert score(m, n) == pytest.approx(score(m + 37, n + 37), abs=1e-10)
    assert score(3, 1) != pytest.approx(score(3, 2), abs=1e-6)
    rotated = rope.rotate(q, torch.tensor([123]))
    assert float(rotated.norm()) == pytest.approx(float(q.norm()), abs=1e-12)  # a rotation


def test_rope_default_positions_and_per_sequence_positions() -> None:
    rope = hf.RotaryEmbedding(4)
    q, k = torch.randn(2, 1, 3, 4), torch.randn(2, 1, 5, 4)
    rq, rk = rope(q, k, offset=10)  # keys at 10..14, queries aligned to the last three
    torch.testing.assert_close(rk, rope.rotate(k, torch.arange(10, 15)))
    torch.testing.assert_close(rq, rope.rotate(q, torch.arange(12, 15)))
    per_seq = torch.tensor([[0, 1, 2], [5, 6, 7]])
    rq, _ = rope(q, q, per_seq)
    torch.testing.assert_close(rq[1:], rope.rotate(q[1:], torch.tensor([5, 6, 7])))


def test_rope_errors() -> None:
    with pytest.raises(ValueError, match="dim must be even"):
        hf.RotaryEmbedding(5)
    with pytest.raises(ValueError, match="base must be a number > 1"):
        hf.RotaryEmbedding(4, base=1)
    with pytest.raises(ValueError, match="do not match the length"):
        hf.RotaryEmbedding(4).rotate(torch.randn(1, 1, 3, 4), torch.arange(4))
    with pytest.raises(ValueError, match="rotary dim is 4"):
        hf.RotaryEmbedding(4).rotate(torch.randn(1, 1, 3, 6), torch.arange(3))


def test_rotary_attention_matches_a_float64_reference() -> None:
    E, H = 16, 2
    D = E // H
    mha = hf.MultiHeadAttention(E, H, rotary=hf.RotaryEmbedding(D)).double()
    x = torch.randn(2, 6, E, dtype=torch.float64)
    out, _ = mha(x, causal=True)
    q = mha.q_proj(x).view(2, 6, H, D).transpose(1, 2)
    k = mha.k_proj(x).view(2, 6, H, D).transpose(1, 2)
    v = mha.v_proj(x).view(2, 6, H, D).transpose(1, 2)
    q, k = rope_reference(q, list(range(6))), rope_reference(k, list(range(6)))
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), -math.inf)
    ref = mha.out_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 6, E))
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("H, expected", [
    (8, [2.0 ** -(i + 1) for i in range(8)]),
    (4, [2.0 ** -(2 * (i + 1)) for i in range(4)]),
    (6, [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]),
    (1, [2.0 ** -8]),
])
def test_alibi_slopes(H: int, expected: list[float]) -> None:
    torch.testing.assert_close(alibi_slopes(H), torch.tensor(expected, dtype=torch.float64))


def test_alibi_bias_and_attention_match_formula() -> None:
    H, L_q, L_k = 4, 3, 7
    alibi = hf.ALiBi(H)
    bias = alibi(L_q, L_k, dtype=torch.float64)
    slopes = alibi_slopes(H).tolist()
    ref = torch.empty(H, L_q, L_k, dtype=torch.float64)
    for h in range(H):
        for i in range(L_q):
            p = i + L_k - L_q
            for j in range(L_k):
                ref[h, i, j] = -slopes[h] * abs(p - j)
    torch.testing.assert_close(bias, ref, atol=0, rtol=0)
    q, k, v = (torch.randn(2, H, n, 8, dtype=torch.float64) for n in (L_q, L_k, L_k))
    out, w = hf.scaled_dot_product_attention(q, k, v, bias, causal=True, need_weights=True)
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)
    for h in range(H):  # the paper's causal form: + m_h * (j - p) on j <= p
        for i in range(L_q):
            p = i + L_k - L_q
            for j in range(L_k):
                scores[:, h, i, j] += slopes[h] * (j - p) if j <= p else -math.inf
    torch.testing.assert_close(w, scores.softmax(-1), atol=1e-12, rtol=0)
    torch.testing.assert_close(out, scores.softmax(-1) @ v, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="num_heads must be a positive integer"):
        hf.ALiBi(0)


class _NoFloat64OnMeta(TorchDispatchMode):
    """A stand-in for Apple's MPS on machines without one: an operation that makes a float64
    tensor on the meta device fails the way MPS does ("Cannot convert a MPS Tensor to
    float64 dtype")."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "meta" \
                    and t.dtype == torch.float64:
                raise TypeError(f"{func}: cannot make a float64 tensor on this device")
        return out


def test_rotary_and_alibi_run_on_a_device_without_float64(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The angles and the ALiBi bias are computed in float64 where the device has it (CPU,
    CUDA) and on the CPU otherwise; the float32 results then move to the device."""
    monkeypatch.delitem(positional_rotary._FLOAT64, "meta", raising=False)  # probe it anew
    E, H = 16, 2
    with _NoFloat64OnMeta():
        q, k = torch.randn(1, H, 5, 8, device="meta"), torch.randn(1, H, 5, 8, device="meta")
        q2, k2 = hf.RotaryEmbedding(8)(q, k, offset=3)
        rotated = hf.RotaryEmbedding(8).rotate(q, torch.arange(5))  # positions on the CPU
        bias = hf.ALiBi(4).to("meta")(5, 7)
        mha = hf.MultiHeadAttention(E, H, rotary=hf.RotaryEmbedding(E // H)).to("meta")
        y, _ = mha(torch.randn(2, 5, E, device="meta"), causal=True)  # default positions
        assert not positional_rotary.has_float64("meta")  # the probe found none
    for t in (q2, k2, rotated, bias, y):
        assert t.device.type == "meta" and t.dtype == torch.float32
    assert bias.shape == (4, 5, 7) and y.shape == (2, 5, E)
    assert positional_rotary.has_float64("cpu")
    # The CPU path is the float64 one: the float32 bias equals the float64 formula, cast.
    torch.testing.assert_close(hf.ALiBi(4)(5, 7), hf.ALiBi(4)(5, 7, dtype=torch.float64).float(),
                               rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rotation_is_the_two_halves_written_out_bit_for_bit(dtype: torch.dtype) -> None:
    """``x * [cos, cos] + [x2, x1] * [-sin, sin]`` is ``(x1 cos - x2 sin, x2 cos + x1 sin)``
    with the same roundings: equal bits, not only close."""
    torch.manual_seed(0)
    rope = hf.RotaryEmbedding(8, base=500.0)
    x = torch.randn(2, 3, 5, 8, dtype=dtype)
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    angles = positions.double()[:, None, :, None] * (
        500.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8))  # (B, 1, L, D/2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    x1, x2 = x[..., :4], x[..., 4:]
    expected = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    assert torch.equal(rope.rotate(x, positions), expected)
    # the tables: [cos, cos] and [-sin, sin]
    full_cos, signed_sin = rope.tables(positions, dtype, torch.device("cpu"))
    assert torch.equal(full_cos, torch.cat([cos, cos], dim=-1))
    assert torch.equal(signed_sin, torch.cat([-sin, sin], dim=-1))
