"""FeedForward and GatedFeedForward without autograd apply their activation in place
(issue 24, item 13; the gated MLP for issue 20's forward speed).

A padded BERT batch was 0.93-0.94x transformers' speed: each layer allocated two fresh
``(B, L, d_ff)`` tensors (``linear1``'s output and the activation's), tens of MB that the
system allocator hands back as new pages every layer. Under ``no_grad`` the activation now
overwrites ``linear1``'s output, unless something else can hold that tensor (autograd, a
hook on ``hook_pre``, a PyTorch forward hook on ``linear1``). These tests check that it does
so, that the numbers do not change, and that a kept activation is never overwritten.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import handformer as hf
from handformer import layers
from handformer.inspect import run_with_cache
from handformer.layers import FeedForward, GatedFeedForward

ACTS = ["relu", "gelu", "gelu_tanh", "silu"]
IN_PLACE_OP = {"relu": "aten::relu_", "gelu": "aten::gelu_", "gelu_tanh": "aten::gelu_",
               "silu": "aten::silu_"}


def ops(fn) -> set[str]:
    """The aten op names ``fn()`` runs."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


def kept_by_a_hook(linear: torch.nn.Module, ff: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Run ``ff(x)`` without autograd while a PyTorch forward hook on ``linear`` keeps its
    output; return the kept tensor (as it is after the forward)."""
    kept: list[torch.Tensor] = []
    handle = linear.register_forward_hook(lambda m, i, o: kept.append(o))
    try:
        with torch.no_grad():
            ff(x)
    finally:
        handle.remove()
    return kept[0]


def reference(ff: FeedForward, x: torch.Tensor, activation: str) -> torch.Tensor:
    """The feed-forward in float64, with torch.nn's activations."""
    act = {"relu": torch.nn.ReLU(), "gelu": torch.nn.GELU(),
           "gelu_tanh": torch.nn.GELU(approximate="tanh"), "silu": torch.nn.SiLU()}[activation]
    w1, b1 = ff.linear1.weight.double(), ff.linear1.bias.double()
    w2, b2 = ff.linear2.weight.double(), ff.linear2.bias.double()
    return act(x.double() @ w1.T + b1) @ w2.T + b2


@pytest.mark.parametrize("activation", ACTS)
def test_no_grad_runs_the_activation_in_place_with_the_same_numbers(activation: str) -> None:
    torch.manual_seed(0)
    ff = FeedForward(8, 32, activation=activation).eval()
    x = torch.randn(3, 5, 8)
    with_grad = ff(x)
    assert with_grad.requires_grad
    with torch.no_grad():
        no_grad = ff(x)
    with torch.inference_mode():
        inference = ff(x)
    torch.testing.assert_close(no_grad, with_grad.detach(), rtol=0, atol=0)
    torch.testing.assert_close(inference, with_grad.detach(), rtol=0, atol=0)
    torch.testing.assert_close(no_grad.double(), reference(ff, x, activation))
    name = IN_PLACE_OP[activation]
    with torch.no_grad():
        assert name in ops(lambda: ff(x))
    assert name not in ops(lambda: ff(x))  # with autograd: out of place


def test_a_kept_pre_activation_is_never_overwritten() -> None:
    torch.manual_seed(0)
    ff = FeedForward(8, 32, activation="gelu").eval()
    x = torch.randn(2, 4, 8)
    expected = ff.linear1(x).detach()
    # handformer's own hook point
    with torch.no_grad():
        _, cache = run_with_cache(ff, x, names="hook_pre")
    torch.testing.assert_close(cache["hook_pre"], expected, rtol=0, atol=0)
    # a PyTorch forward hook on linear1 that keeps its output
    torch.testing.assert_close(kept_by_a_hook(ff.linear1, ff, x), expected, rtol=0, atol=0)
    # a global PyTorch forward hook
    kept: list[torch.Tensor] = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, i, o: kept.append(o) if m is ff.linear1 else None)
    try:
        with torch.no_grad():
            ff(x)
    finally:
        handle.remove()
    torch.testing.assert_close(kept[0], expected, rtol=0, atol=0)


def test_without_the_hook_check_a_kept_tensor_would_be_overwritten(monkeypatch) -> None:
    """The hook check above matters: skip it and the kept tensor holds GELU's output."""
    torch.manual_seed(0)
    ff = FeedForward(8, 32, activation="gelu").eval()
    x = torch.randn(2, 4, 8)
    expected = ff.linear1(x).detach()
    monkeypatch.setattr(layers, "_may_overwrite", lambda h, *rest: not h.requires_grad)
    kept = kept_by_a_hook(ff.linear1, ff, x)
    assert not torch.equal(kept, expected)
    torch.testing.assert_close(kept, torch.nn.functional.gelu(expected))


def test_a_replaced_activation_function_is_respected() -> None:
    ff = FeedForward(8, 16, activation="gelu").eval()
    ff.activation = torch.tanh
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        out = ff(x)
    torch.testing.assert_close(out, ff.linear2(torch.tanh(ff.linear1(x))))


def test_encoder_and_causal_lm_outputs_unchanged_under_no_grad() -> None:
    torch.manual_seed(0)
    enc = hf.Encoder(lambda: hf.EncoderLayer(16, 2, 32, dropout=0.0, activation="gelu"),
                     2).eval()
    x = torch.randn(2, 6, 16)
    with torch.no_grad():
        fast = enc(x).last_hidden_state
    torch.testing.assert_close(fast, enc(x).last_hidden_state.detach(), rtol=0, atol=0)
    lm = hf.CausalLM(hf.CausalLMConfig(vocab_size=11, max_len=8, d_model=8, num_heads=2,
                                       num_layers=2, d_ff=16)).eval()
    ids = torch.randint(11, (2, 7))
    with torch.no_grad():
        fast = lm(ids).logits
    torch.testing.assert_close(fast, lm(ids).logits.detach(), rtol=0, atol=0)


def gated_reference(ff: GatedFeedForward, x: torch.Tensor, activation: str) -> torch.Tensor:
    """The gated feed-forward in float64, with torch.nn's activations."""
    act = {"silu": torch.nn.SiLU(), "gelu_tanh": torch.nn.GELU(approximate="tanh")}[activation]
    gate, up, down = (m.weight.double() for m in (ff.gate_proj, ff.up_proj, ff.down_proj))
    x = x.double()
    return (act(x @ gate.T) * (x @ up.T)) @ down.T


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_mlp_overwrites_the_gate_without_autograd(activation: str) -> None:
    torch.manual_seed(0)
    ff = GatedFeedForward(8, 32, activation=activation).eval()
    x = torch.randn(3, 5, 8)
    with_grad = ff(x)
    with torch.inference_mode():
        fast = ff(x)
    torch.testing.assert_close(fast, with_grad.detach(), rtol=0, atol=0)
    torch.testing.assert_close(fast.double(), gated_reference(ff, x, activation))
    with torch.no_grad():
        seen = ops(lambda: ff(x))
    assert IN_PLACE_OP[activation] in seen and "aten::mul_" in seen
    assert not {IN_PLACE_OP[activation], "aten::mul_"} & ops(lambda: ff(x))


def test_gated_mlp_keeps_a_hooked_gate_and_up_intact() -> None:
    torch.manual_seed(0)
    ff = GatedFeedForward(8, 32).eval()
    x = torch.randn(2, 4, 8)
    gate, up = ff.gate_proj(x).detach(), ff.up_proj(x).detach()
    with torch.no_grad():
        _, cache = run_with_cache(ff, x, names=["hook_pre", "hook_pre_linear", "hook_post"])
    torch.testing.assert_close(cache["hook_pre"], gate, rtol=0, atol=0)
    torch.testing.assert_close(cache["hook_pre_linear"], up, rtol=0, atol=0)
    torch.testing.assert_close(cache["hook_post"], torch.nn.functional.silu(gate) * up,
                               rtol=0, atol=0)
    torch.testing.assert_close(kept_by_a_hook(ff.gate_proj, ff, x), gate, rtol=0, atol=0)
