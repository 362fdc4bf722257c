"""SparseAutoencoder and Transcoder against float64 references written out here: every
activation kind, JumpReLU's threshold edge, TopK's tie rule, the pre-encoder bias, the skip
term, the input scalings, and the options refused at construction."""

from __future__ import annotations

import math

import pytest
import torch

from handformer.features import SparseAutoencoder, Transcoder
from handformer.features.dictionary import topk_activation

D, F, OUT = 6, 20, 5


def randomise(d, seed=0):
    """Random float64 parameters (biases and thresholds included), returned as a dict."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.7)
        if d.threshold is not None:
            d.threshold.abs_()
    return {n: p.detach().clone() for n, p in d.named_parameters()}


def reference(p, x, *, activation, k=None, shift=False, scale=None, skip=False):
    """The maths of a dictionary in plain float64 (x: (N, D))."""
    xs = x * scale if scale is not None else x
    pre = (xs - (p["b_dec"] if shift else 0)) @ p["W_enc"] + p["b_enc"]
    if activation == "relu":
        acts = torch.where(pre > 0, pre, torch.zeros_like(pre))
    elif activation == "jumprelu":
        acts = torch.where(pre > p["threshold"], pre, torch.zeros_like(pre))
    else:  # topk, lowest index among ties, then ReLU
        acts = torch.zeros_like(pre)
        for n in range(pre.shape[0]):
            order = sorted(range(pre.shape[1]), key=lambda f: (-pre[n, f].item(), f))[:k]
            for f in order:
                acts[n, f] = max(pre[n, f].item(), 0.0)
    out = acts @ p["W_dec"] + p["b_dec"]
    if scale is not None:
        out = out / scale
    if skip:
        out = out + x @ p["W_skip"]
    return acts, out


@pytest.mark.parametrize("activation", ["relu", "jumprelu", "topk"])
@pytest.mark.parametrize("shift", [False, True])
def test_sae_matches_the_float64_maths(activation, shift):
    k = 4 if activation == "topk" else None
    sae = SparseAutoencoder(D, F, activation=activation, k=k, apply_b_dec_to_input=shift,
                            dtype=torch.float64)
    p = randomise(sae)
    x = torch.randn(7, D, dtype=torch.float64)
    acts, out = reference(p, x, activation=activation, k=k, shift=shift)
    torch.testing.assert_close(sae.encode(x), acts, rtol=0, atol=1e-12)
    torch.testing.assert_close(sae.decode(acts), acts @ p["W_dec"] + p["b_dec"],
                               rtol=0, atol=1e-12)
    torch.testing.assert_close(sae(x), out, rtol=0, atol=1e-12)
    if activation == "topk":
        assert ((sae.encode(x) != 0).sum(-1) <= k).all()


def test_the_pre_encoder_bias_is_subtracted_only_when_asked():
    """b_dec shifts the input before encoding (SAELens' apply_b_dec_to_input): with a large
    b_dec the two options give different features."""
    on = SparseAutoencoder(D, F, apply_b_dec_to_input=True, dtype=torch.float64)
    p = randomise(on, seed=3)
    off = SparseAutoencoder(D, F, apply_b_dec_to_input=False, dtype=torch.float64)
    off.load_state_dict(on.state_dict())
    x = torch.randn(5, D, dtype=torch.float64)
    expected = torch.relu((x - p["b_dec"]) @ p["W_enc"] + p["b_enc"])
    torch.testing.assert_close(on.encode(x), expected, rtol=0, atol=1e-12)
    assert (on.encode(x) - off.encode(x)).abs().max() > 1e-3


def test_jumprelu_is_off_at_the_threshold_and_on_just_above():
    sae = SparseAutoencoder(2, 3, activation="jumprelu", apply_b_dec_to_input=False,
                            dtype=torch.float64)
    with torch.no_grad():
        sae.W_enc.copy_(torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]))
        sae.b_enc.zero_()
        sae.threshold.copy_(torch.tensor([0.5, 0.5, 0.25]))
    x = torch.tensor([[0.5, 0.5 + 1e-12]], dtype=torch.float64)
    acts = sae.encode(x)
    # feature 0: pre = 0.5 = threshold -> off; feature 1: just above -> on (its value, not 1);
    # feature 2: pre = 0.5 > 0.25 -> on
    assert acts.tolist() == [[0.0, 0.5 + 1e-12, 0.5]]


def test_topk_keeps_the_lowest_indices_among_ties():
    pre = torch.tensor([[0.0, 3.0, 1.0, 3.0, 1.0, 1.0, 2.0]])
    # k = 4: 3, 3, 2 are kept; one of the three 1.0 ties: the lowest index, 2
    assert topk_activation(pre, 4).tolist() == [[0, 3, 1, 3, 0, 0, 2]]
    # k = 5: two of the ties, indices 2 and 4
    assert topk_activation(pre, 5).tolist() == [[0, 3, 1, 3, 1, 0, 2]]
    # a tie for the whole row: the first k
    flat = torch.full((1, 9), 2.0)
    assert topk_activation(flat, 3).tolist() == [[2, 2, 2, 0, 0, 0, 0, 0, 0]]
    # negative values kept by rank are still ReLU'd
    assert topk_activation(torch.tensor([[-1.0, -2.0, -3.0]]), 2).tolist() == [[0, 0, 0]]


def test_topk_ties_do_not_depend_on_the_input_order_of_equal_values():
    """Many equal values in wide rows (where torch.topk's own order among ties is not
    specified): the kept set is always the lowest-index ties."""
    g = torch.Generator().manual_seed(1)
    pre = torch.randint(0, 3, (64, 500), generator=g).float()  # lots of ties at every value
    acts = topk_activation(pre, 37)
    for row, out in zip(pre, acts, strict=True):
        order = sorted(range(row.numel()), key=lambda f: (-row[f].item(), f))[:37]
        expected = torch.zeros_like(row)
        expected[order] = row[order].clamp(min=0)
        assert torch.equal(out, expected)


@pytest.mark.parametrize("activation", ["relu", "jumprelu", "topk"])
def test_transcoder_with_and_without_the_skip_term(activation):
    k = 3 if activation == "topk" else None
    for skip in (False, True):
        tc = Transcoder(D, F, OUT, activation=activation, k=k, skip=skip, dtype=torch.float64)
        p = randomise(tc, seed=5)
        x = torch.randn(4, D, dtype=torch.float64)
        acts, out = reference(p, x, activation=activation, k=k, skip=skip)
        torch.testing.assert_close(tc.encode(x), acts, rtol=0, atol=1e-12)
        torch.testing.assert_close(tc(x), out, rtol=0, atol=1e-12)
        assert tc(x).shape == (4, OUT)
        if skip:  # the skip term is a real part of the output
            assert (out - (acts @ p["W_dec"] + p["b_dec"])).abs().max() > 1e-3


def test_input_scalings():
    x = torch.randn(3, D, dtype=torch.float64) * 10
    const = SparseAutoencoder(D, F, input_scale=0.25, dtype=torch.float64)
    p = randomise(const, seed=7)
    _, out = reference(p, x, activation="relu", shift=True, scale=0.25)
    torch.testing.assert_close(const(x), out, rtol=0, atol=1e-12)
    rescale = SparseAutoencoder(D, F, normalize_activations="constant_norm_rescale",
                                dtype=torch.float64)
    rescale.load_state_dict(const.state_dict())
    s = math.sqrt(D) / x.norm(dim=-1, keepdim=True)
    _, out = reference(p, x, activation="relu", shift=True, scale=s)
    torch.testing.assert_close(rescale(x), out, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="needs s"):
        rescale.decode(rescale.encode(x))


def test_float32_and_bfloat16_dictionaries_return_the_input_dtype():
    x = torch.randn(2, 3, D)
    for dtype in (torch.float32, torch.bfloat16):
        sae = SparseAutoencoder(D, F, dtype=dtype)
        assert sae.encode(x).dtype == dtype
        assert sae(x).dtype == torch.float32 and sae(x).shape == x.shape


@pytest.mark.parametrize(("make", "match"), [
    (lambda: SparseAutoencoder(0, F), "d_in must be a positive integer"),
    (lambda: SparseAutoencoder(D, F, activation="gelu"), "activation must be one of"),
    (lambda: SparseAutoencoder(D, F, activation="topk"), "k must be a positive integer"),
    (lambda: SparseAutoencoder(D, F, activation="topk", k=F + 1), "k must be at most d_sae"),
    (lambda: SparseAutoencoder(D, F, k=3), "k is for activation='topk' only"),
    (lambda: SparseAutoencoder(D, F, normalize_activations="layer_norm"),
     "normalize_activations must be one of"),
    (lambda: SparseAutoencoder(D, F, input_scale=0.0), "input_scale must be a positive"),
    (lambda: SparseAutoencoder(D, F, dtype=torch.int32), "dtype must be one of"),
    (lambda: Transcoder(D, F, apply_b_dec_to_input=True),
     "apply_b_dec_to_input must be False for a Transcoder"),
    (lambda: Transcoder(D, F, skip="yes"), "skip must be True or False"),
])
def test_bad_options_are_refused_by_name(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_input_width_is_checked():
    sae = SparseAutoencoder(D, F)
    with pytest.raises(ValueError, match=r"d_in = 6 in the last dim, got shape \(2, 7\)"):
        sae(torch.randn(2, 7))
