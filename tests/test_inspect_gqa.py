"""Grouped-query attention done right: patching a KV head patches what every query head of its
group reads, shape (layers, num_kv_heads); ablating or patching a query head leaves the KV
head the others share; attribution adds up per query head."""

from __future__ import annotations

import pytest
import torch

import handformer as hf
from handformer.inspect import (
    attribution_patching,
    head_ablation_sweep,
    patching_sweep,
    run_with_cache,
)

V, H, H_KV = 24, 4, 2


def gqa_model(seed: int = 0) -> hf.CausalLM:
    """A tiny rotary CausalLM whose attention layers have 4 query heads and 2 KV heads."""
    torch.manual_seed(seed)
    model = hf.CausalLM(hf.CausalLMConfig(vocab_size=V, max_len=16, d_model=16, num_heads=H,
                                          num_kv_heads=H_KV, num_layers=2, d_ff=32,
                                          positional="rotary"))
    assert model.blocks[0].attn.k_proj.out_features == 16 // H * H_KV
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.4)
    return model.double().eval()


def metric(out: object) -> torch.Tensor:
    return out.logits[:, -1, 1].mean() - out.logits[:, -1, 2].mean()


def ids_pair() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    clean = torch.randint(0, V, (2, 6))
    corrupted = clean.clone()
    corrupted[:, 1] = (corrupted[:, 1] + 5) % V
    return clean, corrupted


def run_with_torch_hook(model: hf.CausalLM, ids: torch.Tensor, module: torch.nn.Module,
                        edit: object, *, pre: bool = False) -> float:
    """metric of ``model(ids)`` with a plain torch hook editing ``module``'s output (input)."""
    handle = (module.register_forward_pre_hook(edit) if pre
              else module.register_forward_hook(edit))
    try:
        with torch.no_grad():
            return float(metric(model(ids)))
    finally:
        handle.remove()


@pytest.mark.parametrize("hook", ["k", "v"])
def test_patching_a_kv_head_is_patching_its_projection_rows(hook: str) -> None:
    model = gqa_model()
    clean, corrupted = ids_pair()
    effects = patching_sweep(model, clean, corrupted, metric, hook=hook)
    assert effects.shape == (2, H_KV)
    with torch.no_grad():
        base = float(metric(model(corrupted)))
    D = 16 // H
    for layer in range(2):
        proj = getattr(model.blocks[layer].attn, f"{hook}_proj")
        kept = {}
        handle = proj.register_forward_hook(lambda m, a, out, kept=kept: kept.update(x=out))
        with torch.no_grad():
            model(clean)
        handle.remove()
        for g in range(H_KV):
            def patch(m: object, a: object, out: torch.Tensor, g: int = g,
                      kept: dict = kept) -> torch.Tensor:
                out = out.clone()
                out[..., g * D:(g + 1) * D] = kept["x"][..., g * D:(g + 1) * D]
                return out
            expected = run_with_torch_hook(model, corrupted, proj, patch) - base
            assert effects[layer, g] == pytest.approx(expected, abs=1e-10)


def test_query_head_edits_leave_the_shared_kv_head() -> None:
    """Zeroing query head h's output (out_proj's input slice) is what the sweep measures; its
    KV-group partner keeps working (its own ablation differs)."""
    model = gqa_model(2)
    clean, _ = ids_pair()
    effects = head_ablation_sweep(model, clean, metric)
    assert effects.shape == (2, H)
    with torch.no_grad():
        base = float(metric(model(clean)))
    D = 16 // H
    for layer in range(2):
        out_proj = model.blocks[layer].attn.out_proj
        for h in range(H):
            def zero(m: object, args: tuple[torch.Tensor], h: int = h) -> tuple[torch.Tensor]:
                x = args[0].clone()
                x[..., h * D:(h + 1) * D] = 0.0
                return (x,)
            expected = run_with_torch_hook(model, clean, out_proj, zero, pre=True) - base
            assert effects[layer, h] == pytest.approx(expected, abs=1e-10)
    # heads 0 and 1 share KV head 0, yet each has its own effect
    assert (effects[:, 0] - effects[:, 1]).abs().max() > 1e-6


@pytest.mark.parametrize("hook", ["k", "v", "q", "pattern", "z"])
def test_attribution_patching_has_the_sweep_shape_and_agrees(hook: str) -> None:
    model = gqa_model(3)
    clean, corrupted = ids_pair()
    with torch.no_grad():  # a small perturbation: the corrupted tokens' embeddings nearby
        for a, b in zip(clean[:, 1].tolist(), corrupted[:, 1].tolist(), strict=True):
            model.tok_emb.weight[b] = model.tok_emb.weight[a] + 0.01 * torch.randn(16)
    estimate = attribution_patching(model, clean, corrupted, metric, hook=hook)
    exact = patching_sweep(model, clean, corrupted, metric, hook=hook)
    assert estimate.shape == exact.shape == (2, H_KV if hook in ("k", "v") else H)
    r = torch.corrcoef(torch.stack([estimate.flatten(), exact.flatten()]))[0, 1]
    assert r > 0.99, float(r)


def test_query_heads_add_up_in_attribution() -> None:
    model = gqa_model(4)
    clean, _ = ids_pair()
    out, cache = run_with_cache(model, clean)
    heads, labels = cache.stack_head_results(return_labels=True, incl_remainder=True)
    assert labels[:H] == [f"L0H{h}" for h in range(H)] and len(labels) == 2 * H + 1
    for layer in range(2):
        total = heads[layer * H:(layer + 1) * H].sum(0)
        expected = cache["attn_out", layer] - model.blocks[layer].attn.out_proj.bias
        torch.testing.assert_close(total, expected)
    attrs = cache.logit_attrs(heads, 5, incl_bias=True)
    torch.testing.assert_close(attrs.sum(0), out.logits[..., 5])
