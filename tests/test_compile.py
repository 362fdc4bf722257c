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


@pytest.mark.parametrize("name", ["full", "linear"])
def test_compiled_generate_gives_the_eager_tokens(name: str) -> None:
    """generate(compile=True): one compiled decoding step on fixed-shape caches; the same
    greedy tokens as the eager default (left padding included), the graph reused by a
    second call."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    lm = hf.CausalLM(hf.CausalLMConfig(vocab_size=31, max_len=40, d_model=E, num_heads=H,
                                       num_layers=2, d_ff=F, attention=name)).eval()
    with torch.no_grad():  # larger weights: well separated logits, varied tokens
        for p in lm.parameters():
            if p.dim() > 1:
                p.mul_(8)
    ids = torch.randint(0, 31, (B, L))
    attention_mask = torch.ones(B, L, dtype=torch.long)
    attention_mask[1, :3] = 0  # left padding
    eager = lm.generate(ids, attention_mask=attention_mask, max_new_tokens=12)
    for _ in range(2):
        compiled_ids = lm.generate(ids, attention_mask=attention_mask, max_new_tokens=12,
                                   compile=True, compile_backend="aot_eager")
        assert compiled_ids.tolist() == eager.tolist()
    assert len(set(eager[:, L:].flatten().tolist())) > 2  # not one repeated token


def test_compiled_gpt2_generate_matches_transformers(tmp_path) -> None:  # noqa: ANN001
    """A tiny random GPT-2 folder: transformers' greedy tokens = handformer eager = compiled."""
    transformers = pytest.importorskip("transformers")
    import warnings

    from handformer.pretrained import load_gpt2

    torch._dynamo.reset()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2,
                                         n_head=4, initializer_range=0.2)
        reference = transformers.GPT2LMHeadModel(config).eval()
        reference.save_pretrained(tmp_path)
    model, _ = load_gpt2(tmp_path, tokenizer=False)
    prompt = torch.randint(0, 97, (1, 6))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = reference.generate(prompt, attention_mask=torch.ones_like(prompt),
                                    max_new_tokens=20, do_sample=False, pad_token_id=0)
    ours = model.generate(prompt, max_new_tokens=20)
    compiled_ids = model.generate(prompt, max_new_tokens=20, compile=True,
                                  compile_backend="aot_eager")
    assert ours.tolist() == theirs.tolist() == compiled_ids.tolist()
