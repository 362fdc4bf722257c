"""The decoding step's bfloat16 kernel (models/step_linear.py): oneDNN's blocked inner product.

References: the float64 product of the same bfloat16 values (the kernel sums in float32 and
rounds once to bfloat16, so it is within one bfloat16 rounding of it), and the decoding step
with the kernel switched off (``F.linear``), which must give the same greedy tokens and
logits to bfloat16 rounding.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import handformer as hf
from handformer.models import step_linear
from handformer.models.plain_step import PlainDecodeStep
from handformer.models.step_linear import StepLinears, blocked_bf16_available

needs_blocked = pytest.mark.skipif(not blocked_bf16_available(),
                                   reason="this torch/CPU has no oneDNN bfloat16 inner product")


def _exact(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return out if b is None else out + b.double()


@needs_blocked
@pytest.mark.parametrize("out_in", [(960, 576), (576, 1536), (4096, 640), (7, 5)])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_blocked_bf16_product_is_the_exact_product_rounded_once(out_in: tuple, batch: int,
                                                                 bias: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(*reversed(out_in), bias=bias).to(torch.bfloat16)
    x = torch.randn(batch, out_in[1]).to(torch.bfloat16)
    linear = StepLinears(model)(model.weight, model.bias)
    assert not hasattr(linear, "func")  # not the F.linear fallback (a functools.partial)
    with torch.inference_mode():
        out = linear(x)
    assert out.dtype == torch.bfloat16 and out.shape == (batch, out_in[0])
    exact = _exact(x, model.weight, model.bias)
    # one bfloat16 rounding (2^-8 relative) plus float32 summation (~in * 2^-24, negligible)
    torch.testing.assert_close(out.double(), exact, rtol=2 ** -8, atol=1e-5)


def test_other_dtypes_keep_f_linear() -> None:
    for dtype in (torch.float32, torch.float64, torch.float16):
        model = torch.nn.Linear(4, 3).to(dtype)
        linear = StepLinears(model)(model.weight, model.bias)
        assert linear.func is torch.nn.functional.linear


@needs_blocked
def test_blocked_copies_follow_in_place_changes_and_die_with_the_model() -> None:
    model = torch.nn.Linear(16, 8, bias=False).to(torch.bfloat16)
    x = torch.randn(1, 16).to(torch.bfloat16)
    with torch.inference_mode():
        before = StepLinears(model)(model.weight, None)(x)
    with torch.no_grad():
        model.weight.mul_(-2)  # an optimizer step: same memory, new values
    with torch.inference_mode():
        after = StepLinears(model)(model.weight, None)(x)
    torch.testing.assert_close(after, -2 * before)
    assert len(step_linear._BLOCKED[model]) == 1  # the stale copy was dropped
    alive, held = weakref.ref(model), len(step_linear._BLOCKED)
    del model
    gc.collect()
    assert alive() is None and len(step_linear._BLOCKED) == held - 1  # its copies went with it


def _model(**overrides: object) -> hf.CausalLM:
    base = dict(vocab_size=97, max_len=48, d_model=64, num_heads=4, num_layers=3, d_ff=128,
                positional="rotary", norm="rms", mlp="gated", activation="silu",
                num_kv_heads=2, bias=False)
    torch.manual_seed(0)
    model = hf.CausalLM(hf.CausalLMConfig(**{**base, **overrides})).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(6)
    return model.to(torch.bfloat16)


@needs_blocked
@pytest.mark.parametrize("overrides", [dict(), dict(norm_offset=1.0, sandwich_norm=True,
                                                    qk_norm=True, activation="gelu_tanh")])
def test_bf16_step_equals_the_step_on_f_linear(overrides: dict,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocked kernel changes nothing but the summation order of each product."""
    model = _model(**overrides)
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = {}
    for blocked in (True, False):
        monkeypatch.setattr(step_linear, "blocked_bf16_available", lambda b=blocked: b)
        cache = model.new_cache(capacity=16)
        with torch.inference_mode():
            model(ids[:, :8], cache=cache)
            step = PlainDecodeStep.build(model, cache)
            logits[blocked] = torch.stack([step(ids[:, i]) for i in range(8, 16)], 1).double()
    scale = logits[False].abs().max()
    assert (logits[True] - logits[False]).abs().max() <= 4 * 2 ** -8 * scale
    with torch.inference_mode():
        recomputed = model(ids).logits[:, 8:].double()
    # both are as far from the module path as bfloat16 rounding puts them
    assert (logits[True] - recomputed).abs().max() <= 4 * 2 ** -8 * scale
