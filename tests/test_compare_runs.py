"""inspect.compare_runs: two models on one input, hook point by hook point.

References: the differences computed here from two ``run_with_cache`` calls in numpy float64,
the outputs' agreement from the logits; a model against a copy with one weight changed (the
first point that moves is the one the change feeds; no earlier point moves), one head's
query weights changed (only that head's pattern moves), and a quantized copy.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import handformer as hf
from handformer import inspect
from handformer.models.int8_model import quantize_model

V = 37


def make(seed: int = 0, **overrides: object) -> hf.CausalLM:
    torch.manual_seed(seed)
    config = hf.CausalLMConfig(**{**dict(
        vocab_size=V, max_len=16, d_model=32, num_heads=4, num_layers=3, d_ff=64,
        positional="rotary", norm="rms", mlp="gated", activation="silu", num_kv_heads=2,
        bias=False), **overrides})
    return hf.CausalLM(config).eval()


IDS = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]])


def test_a_model_against_itself_moves_nowhere() -> None:
    model = make()
    comparison = inspect.compare_runs(model, model, IDS)
    assert len(comparison) == len(inspect.hook_names(model)) > 40
    assert all(p.max_abs == 0 and p.rel_l2 == 0 for p in comparison)
    assert comparison.top1_agreement == 1.0 and comparison.mean_kl == 0.0
    assert comparison.first_divergence() is None
    assert not (comparison.only_in_first or comparison.only_in_second)


def test_each_figure_equals_a_float64_recompute() -> None:
    model = make()
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    comparison = inspect.compare_runs(model, other, IDS)
    out_a, cache_a = inspect.run_with_cache(model, IDS)
    out_b, cache_b = inspect.run_with_cache(other, IDS)
    for name in ("blocks.1.hook_resid_post", "blocks.0.attn.hook_pattern", "ln_final.hook_scale"):
        a, b = cache_a[name].double().numpy(), cache_b[name].double().numpy()
        point = comparison[name]
        assert point.max_abs == pytest.approx(np.abs(b - a).max(), rel=1e-12)
        assert point.rel_l2 == pytest.approx(np.linalg.norm(b - a) / np.linalg.norm(a), rel=1e-9)
        rows_a, rows_b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
        cos = (rows_a * rows_b).sum(-1) / (np.linalg.norm(rows_a, axis=-1)
                                           * np.linalg.norm(rows_b, axis=-1))
        assert point.cosine == pytest.approx(cos.mean(), rel=1e-9)
    pattern = comparison["blocks.0.attn.hook_pattern"]
    diff = np.abs(cache_b["blocks.0.attn.hook_pattern"].numpy()
                  - cache_a["blocks.0.attn.hook_pattern"].numpy())
    assert pattern.per_head == pytest.approx(list(diff.max(axis=(0, 2, 3))))
    assert comparison["blocks.1.hook_resid_post"].per_head is None
    la, lb = out_a.logits.detach().double().numpy(), out_b.logits.detach().double().numpy()
    assert comparison.top1_agreement == (la.argmax(-1) == lb.argmax(-1)).mean()
    pa = np.exp(la - la.max(-1, keepdims=True))
    pa /= pa.sum(-1, keepdims=True)
    pb = np.exp(lb - lb.max(-1, keepdims=True))
    pb /= pb.sum(-1, keepdims=True)
    kl = (pa * (np.log(pa) - np.log(pb))).sum(-1).mean()
    assert comparison.mean_kl == pytest.approx(kl, rel=1e-6) and kl > 0
    assert comparison.max_logit_diff == pytest.approx(np.abs(lb - la).max(), rel=1e-9)


def test_the_first_point_that_moves_is_the_one_the_change_feeds() -> None:
    model = make()
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.blocks[1].mlp.down_proj.weight.mul_(1.5)
    comparison = inspect.compare_runs(model, other, IDS)
    names = [p.name for p in comparison]
    first = comparison.first_divergence()
    assert first is not None and first.name == "blocks.1.hook_mlp_out"
    assert all(p.max_abs == 0 for p in comparison.points[:names.index(first.name)])
    assert comparison["blocks.2.hook_resid_post"].rel_l2 > 0
    assert comparison.worst(1)[0].rel_l2 == max(p.rel_l2 for p in comparison)


def test_one_heads_query_weights_move_that_heads_pattern_only() -> None:
    model = make()
    other = copy.deepcopy(model)
    D = model.blocks[0].attn.head_dim
    with torch.no_grad():  # head 2's rows of W_q
        other.blocks[0].attn.q_proj.weight[2 * D:3 * D].mul_(3.0)
    heads = inspect.compare_runs(model, other, IDS,
                                 names="blocks.0.attn.hook_pattern")["blocks.0.attn.hook_pattern"]
    assert heads.per_head[2] > 1e-3
    assert [h for i, h in enumerate(heads.per_head) if i != 2] == [0.0, 0.0, 0.0]


def test_a_quantized_copy_against_its_float32_original() -> None:
    model = make()
    q8 = quantize_model(copy.deepcopy(model), "int8")
    comparison = inspect.compare_runs(model, q8, IDS, names=["blocks.*.hook_resid_post"])
    assert [p.name for p in comparison] == [f"blocks.{i}.hook_resid_post" for i in range(3)]
    assert all(0 < p.rel_l2 < 0.05 and p.cosine > 0.99 for p in comparison)
    assert comparison.top1_agreement >= 0.9 and 0 < comparison.mean_kl < 0.01
    text = comparison.table()
    assert text.splitlines()[0].startswith("top-1 agreement") and "blocks.2.hook_resid_post" in text


def test_padded_positions_are_left_out_of_the_output_figures() -> None:
    model = make()
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.lm_head.weight.add_(torch.randn_like(other.lm_head.weight) * 0.2)
    mask = torch.tensor([[1] * 8, [0] * 5 + [1] * 3])
    comparison = inspect.compare_runs(model, other, IDS, attention_mask=mask)
    la = model(IDS, attention_mask=mask).logits.detach()
    lb = other(IDS, attention_mask=mask).logits.detach()
    keep = mask.bool()
    agree = (la.argmax(-1) == lb.argmax(-1))[keep].double().mean()
    assert comparison.top1_agreement == pytest.approx(float(agree))
    assert comparison.max_logit_diff == pytest.approx(float((lb - la)[keep].abs().max()))


def test_an_unknown_point_is_refused_by_name() -> None:
    model = make()
    with pytest.raises(KeyError, match="blocks.0.hook_nothing"):
        inspect.compare_runs(model, model, IDS, names="blocks.0.hook_nothing")
    with pytest.raises(KeyError, match="no hook point 'nowhere' was compared"):
        inspect.compare_runs(model, model, IDS, names="blocks.0.hook_resid_post")["nowhere"]


def test_points_one_model_lacks_or_shapes_it_differs_on_are_listed_apart() -> None:
    deeper, wider = make(), make(num_layers=2, d_ff=48)
    comparison = inspect.compare_runs(deeper, wider, IDS)
    assert comparison.only_in_first and all(n.startswith("blocks.2.")
                                            for n in comparison.only_in_first)
    assert not comparison.only_in_second
    assert set(comparison.shape_mismatch) == {"blocks.0.mlp.hook_pre", "blocks.0.mlp.hook_post",
                                              "blocks.0.mlp.hook_pre_linear",
                                              "blocks.1.mlp.hook_pre", "blocks.1.mlp.hook_post",
                                              "blocks.1.mlp.hook_pre_linear"}
    compared = {p.name for p in comparison}
    assert "blocks.1.hook_resid_post" in compared and "ln_final.hook_scale" in compared
    assert not compared & (set(comparison.shape_mismatch) | set(comparison.only_in_first))
