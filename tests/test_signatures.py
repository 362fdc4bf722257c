"""One signature for every attention kind: ``mask`` fourth, patterns by keyword, ``scale``.

Functions: ``fn(q, k, v, mask=None, *, causal, scale, need_weights, <pattern>)``; kinds:
``kind(q, k, v, mask=None, *, causal, need_weights, dropout_p, scale)``. ``scale`` is checked
against float64 references (softmax with that scale; the elu+1 kernel of ``scale * q``).
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

import handformer as hf
from handformer import masks
from variant_reference import kernel_reference, padding_keep, qkv, softmax_reference

FUNCTIONS = {
    "full": (hf.scaled_dot_product_attention, {}),
    "local": (hf.local_attention, {"window_size": 5}),
    "strided": (hf.strided_attention, {"stride": 3, "global_tokens": 1}),
    "linear": (hf.linear_attention, {}),
}
KINDS = {
    "full": hf.FullAttention(),
    "local": hf.LocalAttention(5),
    "strided": hf.StridedAttention(3, global_tokens=1),
    "linear": hf.LinearAttention(),
}


def allowed(name: str, L_q: int, L_k: int, causal: bool) -> torch.Tensor:
    """The kind's dense pattern, from the mask builders."""
    if name == "local":
        return masks.window_mask(L_q, L_k, 5, causal=causal)
    if name == "strided":
        return masks.strided_mask(L_q, L_k, 3, global_tokens=1, causal=causal)
    if causal:
        return masks.causal_mask(L_q, L_k)
    return torch.ones(L_q, L_k, dtype=torch.bool)


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_function_signatures_agree(name):
    fn, pattern = FUNCTIONS[name]
    params = inspect.signature(fn).parameters
    names = list(params)
    assert names[:4] == ["q", "k", "v", "mask"]
    assert params["mask"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert params["mask"].default is None
    for keyword in ("causal", "scale", "need_weights", *pattern):
        assert params[keyword].kind is inspect.Parameter.KEYWORD_ONLY, keyword
    assert params["scale"].default is None


@pytest.mark.parametrize("name", list(KINDS))
def test_kind_forward_signatures_agree(name):
    params = inspect.signature(type(KINDS[name]).forward).parameters
    assert list(params)[:5] == ["self", "q", "k", "v", "mask"]
    assert params["mask"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    for keyword in ("causal", "need_weights", "dropout_p", "scale"):
        assert params[keyword].kind is inspect.Parameter.KEYWORD_ONLY, keyword


@pytest.mark.parametrize("name", list(KINDS))
def test_mask_by_position_equals_mask_by_keyword(name):
    q, k, v = qkv(9, 11)
    keep = padding_keep([11, 6], 11)  # (B, 1, 1, L_k)
    fn, pattern = FUNCTIONS[name]
    by_keyword, w_keyword = KINDS[name](q, k, v, mask=keep, causal=True, need_weights=True)
    by_position, w_position = KINDS[name](q, k, v, keep, causal=True, need_weights=True)
    through_fn, _ = fn(q, k, v, keep, causal=True, **pattern)
    torch.testing.assert_close(by_position, by_keyword, atol=0, rtol=0)
    torch.testing.assert_close(w_position, w_keyword, atol=0, rtol=0)
    torch.testing.assert_close(through_fn, by_keyword, atol=1e-12, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["full", "local", "strided"])
def test_softmax_kinds_apply_scale(name, causal):
    q, k, v = qkv(140, 133)  # float64, across a 128-row block boundary
    keep = padding_keep([133, 70], 133)
    ref_out, ref_w = softmax_reference(q, k, v, allowed(name, 140, 133, causal) & keep,
                                       scale=0.3)
    out, w = KINDS[name](q, k, v, keep, causal=causal, need_weights=True, scale=0.3)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)
    torch.testing.assert_close(w, ref_w, atol=1e-10, rtol=0)
    fast, _ = KINDS[name](q, k, v, keep, causal=causal, scale=0.3)  # the fused / tiled path
    torch.testing.assert_close(fast, ref_out, atol=1e-10, rtol=0)
    default, _ = KINDS[name](q, k, v, keep, causal=causal)
    assert not torch.allclose(default, fast)  # 0.3 differs from 1 / sqrt(8)


@pytest.mark.parametrize("causal", [False, True])
def test_linear_scale_multiplies_q_before_the_feature_map(causal):
    q, k, v = qkv(140, 133)
    keep = padding_keep([133, 70], 133)
    pattern = allowed("linear", 140, 133, causal)
    ref_out, ref_w = kernel_reference(q * 0.3, k, v, pattern, key_weight=keep)
    out, w = KINDS["linear"](q, k, v, keep, causal=causal, need_weights=True, scale=0.3)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)
    torch.testing.assert_close(w, ref_w, atol=1e-10, rtol=0)
    default, _ = KINDS["linear"](q, k, v, keep, causal=causal)
    torch.testing.assert_close(default, kernel_reference(q, k, v, pattern, key_weight=keep)[0],
                               atol=1e-10, rtol=0)  # scale=None is 1: phi(q) unscaled


def test_linear_step_and_cache_take_the_same_scale():
    q, k, v = qkv(20, 20)
    kind = hf.LinearAttention()
    full, _ = kind(q, k, v, causal=True, scale=0.5)
    state, outs = None, []
    for t in range(20):
        out, state = kind.step(q[..., t:t + 1, :], k[..., t:t + 1, :], v[..., t:t + 1, :],
                               state, scale=0.5)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=-2), full, atol=1e-12, rtol=0)
    phi = F.elu(q * 0.5) + 1
    assert not torch.allclose(phi, F.elu(q) + 1)


@pytest.mark.parametrize("name", list(KINDS))
@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "0.1"])
def test_bad_scale_is_refused_by_every_kind(name, bad):
    q, k, v = qkv(4, 4)
    with pytest.raises(ValueError, match="scale must be None or a positive finite number"):
        KINDS[name](q, k, v, scale=bad)


@pytest.mark.parametrize("name, keyword", [("local", "window_size"), ("strided", "stride")])
def test_a_pattern_given_by_position_names_its_keyword(name, keyword):
    q, k, v = qkv(4, 4)
    fn = FUNCTIONS[name][0]
    with pytest.raises(TypeError, match=rf"keyword-only argument: '{keyword}'"):
        fn(q, k, v, 3)  # the old positional pattern now lands in mask's place
    with pytest.raises(TypeError, match="mask must be a torch.Tensor, got int"):
        fn(q, k, v, 3, **{keyword: 3})
