"""torch.compile(fullgraph=True): MultiHeadAttention, EncoderLayer, DecoderLayer and CausalLM.

One test per attention kind. ``backend="aot_eager"`` runs the real capture (TorchDynamo with
``fullgraph=True``, so any graph break is an error) and AOT autograd, but skips Inductor's
code generation, which takes about a minute per graph on the 2-core CI machine; the graph
that Inductor would compile is the same. Compiled outputs must match eager within 1e-5,
with padding masks (fully masked rows included) and causal masking; MultiHeadAttention's
parameter gradients too (the other modules run their forward under no_grad, which keeps
the suite under a minute).
"""

from __future__ import annotations

import pytest
import torch

import handformer as hf

pytestmark = pytest.mark.compile

KINDS = ["full", "local", "strided", "linear"]
E, H, F, B, L = 16, 2, 32, 2, 7


def make_kind(name: str) -> hf.AttentionKind:
    return {"full": hf.FullAttention, "local": lambda: hf.LocalAttention(3),
            "strided": lambda: hf.StridedAttention(2, global_tokens=1),
            "linear": hf.LinearAttention}[name]()


def compiled(module: torch.nn.Module) -> torch.nn.Module:
    return torch.compile(module, backend="aot_eager", fullgraph=True)


@pytest.mark.parametrize("name", KINDS)
def test_modules_compile_fullgraph_and_match_eager(name: str) -> None:
    torch._dynamo.reset()
    x = torch.randn(B, L, E)
    keep = torch.ones(B, 1, 1, L, dtype=torch.bool)
    keep[1, ..., :3] = False  # with causal=True, queries 0-2 of batch 1 have no key
    extra = {"local": {"window_size": 3}, "strided": {"stride": 2}}.get(name, {})
    lm = hf.CausalLM(hf.CausalLMConfig(vocab_size=31, max_len=16, d_model=E, num_heads=H,
                                       num_layers=1, d_ff=F, attention=name, **extra))
    ids = torch.randint(0, 31, (B, L))
    attention_mask = torch.ones(B, L, dtype=torch.long)
    attention_mask[1, :3] = 0  # left padding
    cases = [
        ("MultiHeadAttention", hf.MultiHeadAttention(E, H, attention=make_kind(name)),
         lambda m: m(x, mask=keep, causal=True)[0]),
        ("EncoderLayer", hf.EncoderLayer(E, H, F, dropout=0.0, attention=make_kind(name)),
         lambda m: m(x, keep)),
        ("DecoderLayer", hf.DecoderLayer(E, H, F, dropout=0.0, attention=make_kind(name)),
         lambda m: m(x, x.flip(1), mask=keep, memory_mask=keep)),
        ("CausalLM", lm, lambda m: m(ids, attention_mask=attention_mask).logits),
    ]
    for label, module, call in cases:
        module.eval()
        fast = compiled(module)
        with_grads = label == "MultiHeadAttention"  # forward+backward graph: slower to trace
        with torch.set_grad_enabled(with_grads):
            eager_out = call(module)
            compiled_out = call(fast)
        torch.testing.assert_close(compiled_out, eager_out, atol=1e-5, rtol=1e-5, msg=label)
        if with_grads:
            params = list(module.parameters())
            eager_grads = torch.autograd.grad(eager_out.square().sum(), params)
            compiled_grads = torch.autograd.grad(compiled_out.square().sum(), params)
            for a, b in zip(compiled_grads, eager_grads, strict=True):
                assert torch.isfinite(a).all(), label
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=label)


def test_a_graph_break_is_an_error_here() -> None:
    """The tests above would catch a data-dependent branch: fullgraph=True refuses it."""
    torch._dynamo.reset()

    def branchy(t: torch.Tensor) -> torch.Tensor:
        return t * 2 if bool((t > 0).any()) else t

    with pytest.raises(Exception, match="(?i)data-dependent|graph break|Unsupported"):
        torch.compile(branchy, backend="aot_eager", fullgraph=True)(torch.randn(3))
