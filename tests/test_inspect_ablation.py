"""Head ablation and activation patching against independent computations."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import handformer as hf
from handformer.inspect import (
    head_ablation_hooks,
    head_ablation_sweep,
    head_means,
    patching_sweep,
    run_with_hooks,
)
from handformer.pretrained import load_bert
from pretrained_util import tiny_checkpoint


def manual_stack(enc: hf.Encoder, x: torch.Tensor, *, skip_attention: int) -> torch.Tensor:
    """The encoder computed by hand, layer ``skip_attention`` without its attention sublayer
    (its contribution is then the output projection's bias, or nothing without biases)."""
    for i, layer in enumerate(enc.blocks):
        if i == skip_attention:
            bias = layer.attn.out_proj.bias
            attn = torch.zeros_like(x) if bias is None else bias.expand_as(x)
        else:
            attn = layer.attn(layer.ln1(x) if layer.norm_first else x)[0]
        if layer.norm_first:
            x = x + attn
            x = x + layer.mlp(layer.ln2(x))
        else:
            x = layer.ln1(x + attn)
            x = layer.ln2(x + layer.mlp(x))
    return x


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_zero_ablating_every_head_of_a_layer_removes_its_attention(norm_first: bool,
                                                                   bias: bool) -> None:
    enc = hf.Encoder(hf.EncoderLayer(12, 3, 24, dropout=0.0, norm_first=norm_first,
                                     bias=bias), 3).eval()
    x = torch.randn(2, 5, 12)
    with torch.no_grad():
        ablated = run_with_hooks(enc, x, hooks=head_ablation_hooks(
            enc, [(1, 0), (1, 1), (1, 2)])).last_hidden_state
        want = manual_stack(enc, x, skip_attention=1)
        assert not torch.allclose(enc(x).last_hidden_state, want, atol=1e-3)
    torch.testing.assert_close(ablated, want, atol=1e-6, rtol=0)


def cosine_metric(mask: torch.Tensor, pooling):  # noqa: ANN001, ANN202
    def metric(out) -> torch.Tensor:  # noqa: ANN001
        e = pooling(out.last_hidden_state, mask)
        return torch.cosine_similarity(e[0], e[1], dim=0)
    return metric


@pytest.fixture(scope="module")
def bundled():  # noqa: ANN201
    model, tok = load_bert()
    enc = tok(["The animal didn't cross the street because it was too tired",
               "The animal was too tired."])
    return model, enc, cosine_metric(enc["attention_mask"], model.sentence_pooling)


def test_sweep_is_independent_of_batching_and_equals_single_runs(bundled) -> None:  # noqa: ANN001
    model, enc, metric = bundled
    heads = [(0, 0), (2, 5), (5, 11), (3, 1), (4, 7)]
    one = head_ablation_sweep(model, enc, metric, heads=heads, batch_size=1)
    many = head_ablation_sweep(model, enc, metric, heads=heads, batch_size=4)
    torch.testing.assert_close(one, many, atol=1e-6, rtol=0, equal_nan=True)
    with torch.no_grad():
        clean = float(metric(model(**enc)))
        for layer, head in heads:
            out = run_with_hooks(model, enc, hooks=head_ablation_hooks(model, [(layer, head)]))
            assert one[layer, head] == pytest.approx(float(metric(out)) - clean, abs=1e-6)
    assert int(torch.isnan(one).sum()) == 72 - len(heads)


def test_mean_ablation_uses_the_masked_mean(tmp_path: Path) -> None:
    tiny_checkpoint(tmp_path, layers=2, heads=4)
    model, _ = load_bert(tmp_path)
    ids = torch.randint(5, 64, (2, 6))
    mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3])
    inputs = {"input_ids": ids, "attention_mask": mask}
    means = head_means(model, inputs)
    assert means.shape == (2, 4, 8)
    seen = {}
    run_with_hooks(model, inputs, hooks={"blocks.1.attn.hook_z": lambda t, n: seen.update(z=t)})
    real = torch.cat([seen["z"][0], seen["z"][1, :3]])  # (9, H, D): the real tokens only
    torch.testing.assert_close(means[1], real.mean(0), atol=1e-6, rtol=0)
    got = {}
    hooks = head_ablation_hooks(model, [(1, 2)], mode="mean", means=means)
    hooks["blocks.1.hook_attn_out"] = lambda t, n: got.update(out=t)
    run_with_hooks(model, inputs, hooks=hooks)
    z = seen["z"].clone()
    z[:, :, 2] = means[1, 2]
    proj = model.blocks[1].attn.out_proj
    torch.testing.assert_close(got["out"], proj(z.flatten(2)), atol=1e-6, rtol=0)


def test_patching_sweeps(bundled) -> None:  # noqa: ANN001
    model, enc, metric = bundled
    same = patching_sweep(model, enc, enc, metric, hook="z", batch_size=24)
    assert same.shape == (6, 12) and float(same.abs().max()) < 1e-6
    # patching the last layer's output at one position makes that row the clean one
    corrupted = dict(enc, input_ids=enc["input_ids"].clone())
    corrupted["input_ids"][0, 2] = 2000
    p = 4
    def row_metric(out) -> torch.Tensor:  # noqa: ANN001
        return out.last_hidden_state[0, p].sum()
    result = patching_sweep(model, enc, corrupted, row_metric, hook="resid_post")
    with torch.no_grad():
        want = float(row_metric(model(**enc)) - row_metric(model(**corrupted)))
    assert result[5, p] == pytest.approx(want, abs=1e-5)
    others = torch.cat([result[5, :p], result[5, p + 1:]])
    assert float(others.abs().max()) < 1e-6
    assert float(result[0, 2].abs()) > 1e-3  # the corrupted token itself matters


def test_bad_arguments(bundled) -> None:  # noqa: ANN001
    model, enc, metric = bundled
    with pytest.raises(ValueError, match=r"layer 6 is out of range: the model has layers 0\.\.5"):
        head_ablation_hooks(model, [(6, 0)])
    with pytest.raises(ValueError, match=r"head 12 is out of range: each layer has heads 0\.\.11"):
        head_ablation_sweep(model, enc, metric, heads=[(0, 12)])
    with pytest.raises(ValueError, match="mode='mean' needs means"):
        head_ablation_hooks(model, [(0, 0)], mode="mean")
    with pytest.raises(ValueError, match="mode must be one of"):
        head_ablation_hooks(model, [(0, 0)], mode="random")
    with pytest.raises(ValueError, match="metric must return one number"):
        head_ablation_sweep(model, enc, lambda o: o.last_hidden_state, heads=[(0, 0)])
    with pytest.raises(ValueError, match="same shapes"):
        patching_sweep(model, enc, {k: v[:1] for k, v in enc.items()}, metric)
    with pytest.raises(ValueError, match="hook must be one of"):
        patching_sweep(model, enc, enc, metric, hook="embed")
