"""float16 and bfloat16 on CPU: every attention kind and module stays finite and close to float64.

What is checked (tolerances are documented in docs/precision.md):

* attention functions (full, local, strided, linear), q and k scaled by 1, 1e2 and 1e4 (the
  largest scores are then ~1e8), with and without ``causal``, with and without weights, and a
  key mask that leaves whole rows without any key: no NaN or inf in the output, the weights or
  the gradients, and ``out``/``weights`` within ``atol = rtol = TOL[dtype]`` of a float64
  reference evaluated on the same (rounded) inputs;
* modules (MultiHeadAttention, post- and pre-LN EncoderLayer, DecoderLayer with
  cross-attention, CausalLM) for every kind: finite for inputs scaled by 1, 1e2 and 1e4 with
  fully masked rows; for unit-scale inputs normwise within ``MODULE_TOL[dtype]`` of a float64
  copy of the same half-precision weights, ``max|out - ref| <= tol * max(1, max|ref|)``;
  parameter gradients finite. (With 1e2-1e4 inputs a module's projections round q and k
  before the softmax, whose scores are then ~1e4-1e8: a rounding of q can legitimately pick
  another key, so only finiteness is asserted there; the attention functions, which get q
  and k exactly, are compared at every scale.)
"""

from __future__ import annotations

import copy

import pytest
import torch

import handformer as hf
from handformer import masks
from variant_reference import kernel_reference, softmax_reference

DTYPES = [torch.float16, torch.bfloat16]
KINDS = ["full", "local", "strided", "linear"]
SCALES = [1.0, 1e2, 1e4]
# Attention functions: atol = rtol (outputs are O(1): values are unit normal).
TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2}
# Modules: normwise, relative to max(1, max|ref|).
MODULE_TOL = {torch.float16: 2e-2, torch.bfloat16: 5e-2}


def make_kind(name: str) -> hf.AttentionKind:
    return {"full": hf.FullAttention, "local": lambda: hf.LocalAttention(5),
            "strided": lambda: hf.StridedAttention(3, global_tokens=1),
            "linear": hf.LinearAttention}[name]()


def allowed_pattern(name: str, L: int, causal: bool) -> torch.Tensor:
    if name == "local":
        return masks.window_mask(L, L, 5, causal=causal)
    if name == "strided":
        return masks.strided_mask(L, L, 3, global_tokens=1, causal=causal)
    return masks.causal_mask(L, L) if causal else torch.ones(L, L, dtype=torch.bool)


def key_mask(B: int, L: int) -> torch.Tensor:
    """(B, 1, 1, L): batch 0 loses keys 0 and 3 (with causal, query 0 has no key left),
    batch 1 loses every key (every row fully masked)."""
    keep = torch.ones(B, 1, 1, L, dtype=torch.bool)
    keep[0, ..., [0, 3]] = False
    keep[1] = False
    return keep


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", KINDS)
def test_attention_kind_is_finite_and_close_to_float64(name: str, dtype: torch.dtype) -> None:
    B, H, L, D = 3, 2, 11, 8
    kind, keep = make_kind(name), key_mask(B, L)
    checked = 0
    for scale in SCALES:
        g = torch.Generator().manual_seed(int(scale))
        q = (torch.randn(B, H, L, D, generator=g) * scale).to(dtype).requires_grad_(True)
        k = (torch.randn(B, H, L, D, generator=g) * scale).to(dtype).requires_grad_(True)
        v = torch.randn(B, H, L, D, generator=g).to(dtype).requires_grad_(True)
        for causal in (False, True):
            allowed = keep & allowed_pattern(name, L, causal)
            if name == "linear":
                ref_out, ref_w = kernel_reference(q.detach(), k.detach(), v.detach(), allowed)
            else:
                ref_out, ref_w = softmax_reference(q.detach(), k.detach(), v.detach(), allowed)
            for need_weights in (False, True):
                out, w = kind(q, k, v, causal=causal, mask=keep, need_weights=need_weights)
                assert out.dtype == dtype
                assert torch.isfinite(out).all(), (scale, causal, need_weights)
                torch.testing.assert_close(out.double(), ref_out, atol=TOL[dtype],
                                           rtol=TOL[dtype])
                assert (out[1] == 0).all()  # every key masked: zeros, not NaN
                if need_weights:
                    assert torch.isfinite(w).all()
                    torch.testing.assert_close(w.double(), ref_w, atol=TOL[dtype],
                                               rtol=TOL[dtype])
                q.grad = k.grad = v.grad = None
                out.float().square().sum().backward()
                for t in (q, k, v):
                    assert torch.isfinite(t.grad).all(), (scale, causal, need_weights)
                checked += 1
    assert checked == len(SCALES) * 4


def module_cases(name: str):
    """(label, module, call(module, x, keep)) for every module that takes an attention kind."""
    E, H, F = 16, 2, 32
    yield "MultiHeadAttention", hf.MultiHeadAttention(E, H, attention=make_kind(name)), \
        lambda m, x, keep: m(x, mask=keep)[0]
    for norm_first in (False, True):
        yield f"EncoderLayer(norm_first={norm_first})", \
            hf.EncoderLayer(E, H, F, dropout=0.0, norm_first=norm_first,
                            attention=make_kind(name)), \
            lambda m, x, keep: m(x, keep)
    yield "DecoderLayer", hf.DecoderLayer(E, H, F, dropout=0.0, attention=make_kind(name)), \
        lambda m, x, keep: m(x, x.flip(1), mask=keep, memory_mask=keep)


def assert_normwise_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype,
                          label: str) -> None:
    assert torch.isfinite(out).all(), label
    err = (out.double() - ref).abs().max().item()
    bound = MODULE_TOL[dtype] * max(1.0, ref.abs().max().item())
    assert err <= bound, f"{label}: error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", KINDS)
def test_modules_are_finite_and_close_to_float64(name: str, dtype: torch.dtype) -> None:
    B, L, E = 2, 9, 16
    keep = key_mask(B, L)
    for label, module, call in module_cases(name):
        low = copy.deepcopy(module).eval().to(dtype)
        ref_module = copy.deepcopy(low).double()  # the same rounded weights, in float64
        for scale in SCALES:
            x = (torch.randn(B, L, E) * scale).to(dtype)
            with torch.no_grad():
                out = call(low, x, keep)
                ref = call(ref_module, x.double(), keep)
            assert out.dtype == dtype
            assert torch.isfinite(out).all(), f"{label} scale={scale:g}"
            if scale == 1.0:
                assert_normwise_close(out, ref, dtype, label)
        # and training mode: gradients of every parameter stay finite with masked rows
        low.train()
        x = torch.randn(B, L, E).to(dtype)
        call(low, x, keep).float().square().mean().backward()
        for pname, p in low.named_parameters():
            assert torch.isfinite(p.grad).all(), f"{label}: {pname}.grad"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", KINDS)
def test_causal_lm_is_finite_and_close_to_float64(name: str, dtype: torch.dtype) -> None:
    extra = {"local": {"window_size": 3}, "strided": {"stride": 2}}.get(name, {})
    config = hf.CausalLMConfig(vocab_size=37, max_len=16, d_model=16, num_heads=2,
                               num_layers=2, d_ff=32, attention=name, **extra)
    model = hf.CausalLM(config).eval().to(dtype)
    ref_model = copy.deepcopy(model).double()
    ids = torch.randint(0, 37, (3, 10))
    attention_mask = torch.ones(3, 10, dtype=torch.long)
    attention_mask[1, :4] = 0  # left padding: the padded queries have no key at all
    attention_mask[2] = 0  # a row with no real token
    with torch.no_grad():
        logits = model(ids, attention_mask=attention_mask).logits
        ref = ref_model(ids, attention_mask=attention_mask).logits
    assert logits.dtype == dtype
    assert_normwise_close(logits, ref, dtype, f"CausalLM({name})")
