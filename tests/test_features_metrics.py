"""evaluate_dictionary against float64 hand computations on a tiny model: explained variance,
L0, dead and dense fractions, CE loss recovered (zero and mean ablation), KL; the sink
(position 0) left out everywhere."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import handformer as hf
from handformer.features import SparseAutoencoder, Transcoder
from handformer.features.metrics import (
    ce_loss_recovered,
    evaluate_dictionaries,
    evaluate_dictionary,
    explained_variance,
    l0,
)
from handformer.inspect import run_with_cache, run_with_hooks

AT = "blocks.0.hook_resid_post"  # not the last block: position 0 matters to later ones


def tiny_lm() -> hf.CausalLM:
    torch.manual_seed(0)
    return hf.CausalLM(hf.CausalLMConfig(vocab_size=40, max_len=32, d_model=16, num_heads=2,
                                         num_layers=2, d_ff=32, norm="rms", mlp="gated",
                                         positional="rotary")).eval()


def random_sae(seed: int = 0, at: str = AT) -> SparseAutoencoder:
    torch.manual_seed(seed)
    sae = SparseAutoencoder(16, 24, activation="relu", hook_name=at)
    with torch.no_grad():
        sae.b_enc.copy_(0.3 * torch.randn(24))
        sae.b_dec.copy_(0.2 * torch.randn(16))
        sae.W_enc.mul_(1.5)
    return sae


def test_formulas_on_plain_tensors() -> None:
    g = torch.Generator().manual_seed(0)
    y = torch.randn(50, 6, generator=g, dtype=torch.float64)
    y_hat = y + 0.3 * torch.randn(50, 6, generator=g, dtype=torch.float64)
    by_hand = 1 - sum(float(((y[i] - y_hat[i]) ** 2).sum()) for i in range(50)) / sum(
        float(((y[i] - y.mean(0)) ** 2).sum()) for i in range(50))
    assert math.isclose(explained_variance(y, y_hat), by_hand, rel_tol=1e-12)
    z = torch.tensor([[0.0, 1.0, 0.0], [2.0, 3.0, 0.5]])
    assert l0(z) == 2.0
    assert ce_loss_recovered(2.0, 2.5, 4.0) == 0.75
    assert math.isnan(ce_loss_recovered(2.0, 2.5, 2.0))


@torch.no_grad()
@pytest.mark.parametrize("AT", [AT, "blocks.1.hook_resid_mid"])  # the second: run_from(1)
def test_evaluate_dictionary_matches_a_float64_hand_computation(AT: str) -> None:  # noqa: N803
    lm, sae = tiny_lm(), random_sae(at=AT)
    ids = torch.randint(0, 40, (6, 12), generator=torch.Generator().manual_seed(1))
    m = evaluate_dictionary(lm, sae, ids, at=AT, batch=4)

    _, cache = run_with_cache(lm, ids, names=AT)
    y = cache[AT][:, 1:].double().reshape(-1, 16)  # positions 1.. only
    W_enc, b_enc = sae.W_enc.double(), sae.b_enc.double()
    W_dec, b_dec = sae.W_dec.double(), sae.b_dec.double()
    z = torch.relu((y - b_dec) @ W_enc + b_enc)
    y_hat = z @ W_dec + b_dec
    ev = 1 - ((y - y_hat) ** 2).sum() / ((y - y.mean(0)) ** 2).sum()
    assert m.tokens == 6 * 11
    assert abs(m.explained_variance - float(ev)) < 1e-5
    assert abs(m.l0 - float((z > 0).sum(-1).double().mean())) < 1e-9
    density = (z > 0).double().mean(0)
    assert m.dead_fraction == float((density == 0).double().mean())
    assert m.dense_fraction == float((density > 0.1).double().mean())
    torch.testing.assert_close(m.density.double(), density)

    def ce_with(value: torch.Tensor | None) -> tuple[float, torch.Tensor]:
        def put(t: torch.Tensor, name: str) -> torch.Tensor:
            out = t.clone()
            out[:, 1:] = value.reshape(6, 11, 16).to(t.dtype)  # the sink keeps its value
            return out
        logits = lm(ids).logits if value is None else run_with_hooks(
            lm, ids, hooks={AT: put}).logits
        logp = F.log_softmax(logits[:, 1:-1].double(), -1)  # predictions of tokens 2..
        return float(-logp.gather(-1, ids[:, 2:, None])[..., 0].mean()), logp

    ce_clean, logp_clean = ce_with(None)
    ce_spliced, logp_spliced = ce_with(y_hat)
    ce_zero, _ = ce_with(torch.zeros_like(y))
    ce_mean, _ = ce_with(y.mean(0).expand_as(y))
    for got, want in ((m.ce_clean, ce_clean), (m.ce_spliced, ce_spliced),
                      (m.ce_zero, ce_zero), (m.ce_mean, ce_mean)):
        assert abs(got - want) < 2e-6, (got, want)
    recovered = (ce_zero - ce_spliced) / (ce_zero - ce_clean)
    assert abs(m.ce_loss_recovered - recovered) < 1e-3
    assert abs(m.ce_loss_recovered_mean - (ce_mean - ce_spliced) / (ce_mean - ce_clean)) < 1e-3
    kl = float((logp_clean.exp() * (logp_clean - logp_spliced)).sum(-1).mean())
    assert abs(m.kl - kl) < 1e-6


def test_a_perfect_dictionary_recovers_everything() -> None:
    """An SAE whose reconstruction is exact (identity through 2 * 16 ReLU latents):
    explained variance 1, CE recovered 1, KL 0."""
    lm = tiny_lm()
    sae = SparseAutoencoder(16, 32, activation="relu", apply_b_dec_to_input=False)
    with torch.no_grad():
        eye = torch.eye(16)
        sae.W_enc.copy_(torch.cat([eye, -eye], 1))
        sae.W_dec.copy_(torch.cat([eye, -eye], 0))
        sae.b_enc.zero_()
        sae.b_dec.zero_()
    ids = torch.randint(0, 40, (4, 10), generator=torch.Generator().manual_seed(2))
    m = evaluate_dictionary(lm, sae, ids, at=AT)
    assert m.explained_variance > 1 - 1e-6
    assert abs(m.ce_loss_recovered - 1) < 1e-4 and abs(m.kl) < 1e-6


@torch.no_grad()
def test_a_transcoder_is_evaluated_on_the_mlp_output_from_the_mlp_input() -> None:
    lm = tiny_lm()
    torch.manual_seed(3)
    tc = Transcoder(16, 24, activation="relu")
    ids = torch.randint(0, 40, (4, 10), generator=torch.Generator().manual_seed(2))
    m = evaluate_dictionary(lm, tc, ids, at="blocks.0.hook_mlp_out")
    # by hand: the MLP's input is the pre-MLP norm of the residual stream after attention
    seen = {}
    h = lm.blocks[0].mlp.register_forward_pre_hook(lambda mod, a: seen.update(x=a[0]))
    try:
        _, cache = run_with_cache(lm, ids, names="blocks.0.hook_mlp_out")
    finally:
        h.remove()
    x = seen["x"][:, 1:].reshape(-1, 16).double()
    y = cache["blocks.0.hook_mlp_out"][:, 1:].reshape(-1, 16).double()
    z = torch.relu(x @ tc.W_enc.double() + tc.b_enc.double())
    y_hat = z @ tc.W_dec.double() + tc.b_dec.double()
    ev = 1 - ((y - y_hat) ** 2).sum() / ((y - y.mean(0)) ** 2).sum()
    assert abs(m.explained_variance - float(ev)) <= 1e-6 * abs(float(ev))


@torch.no_grad()
@pytest.mark.parametrize("positional", ["rotary", "learned"])
def test_run_from_a_block_equals_the_whole_forward_pass(positional: str) -> None:
    """``run_from(resid_pre of block i, start=i)`` gives the forward pass's logits for every
    ``i`` (float64), hooks firing in the blocks it runs; a bad ``start`` is refused."""
    torch.manual_seed(0)
    lm = hf.CausalLM(hf.CausalLMConfig(vocab_size=40, max_len=32, d_model=16, num_heads=2,
                                       num_layers=3, d_ff=32, norm="rms", mlp="gated",
                                       positional=positional, final_softcap=5.0)
                     ).double().eval()
    ids = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(4))
    names = [f"blocks.{i}.hook_resid_pre" for i in range(3)] + ["blocks.2.hook_resid_post"]
    logits, cache = run_with_cache(lm, ids, names=names)
    positions = torch.arange(9).expand(2, 9)
    for start in range(4):
        resid = cache[names[start]]
        torch.testing.assert_close(lm.run_from(resid, positions, start=start), logits.logits,
                                   rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=r"start must be an int in \[0, 3\]"):
        lm.run_from(resid, positions, start=4)


@torch.no_grad()
def test_several_dictionaries_at_once_equal_each_alone() -> None:
    """evaluate_dictionaries shares the forward passes; each site's metrics are what it gets
    evaluated alone (an SAE in block 1, another in block 0, a transcoder in block 1)."""
    lm = tiny_lm()
    torch.manual_seed(5)
    dicts = {"blocks.1.hook_resid_post": random_sae(1, "blocks.1.hook_resid_post"),
             AT: random_sae(2),
             "blocks.1.hook_mlp_out": Transcoder(16, 24, activation="relu")}
    ids = torch.randint(0, 40, (6, 12), generator=torch.Generator().manual_seed(1))
    together = evaluate_dictionaries(lm, dicts, ids, batch=4)
    assert list(together) == list(dicts)
    for at, d in dicts.items():
        alone = evaluate_dictionary(lm, d, ids, at=at, batch=4).to_dict()
        got = together[at].to_dict()
        assert got.keys() == alone.keys()
        for key, value in alone.items():
            if isinstance(value, float):
                assert math.isclose(got[key], value, rel_tol=1e-5, abs_tol=1e-6), (at, key)
            else:
                assert got[key] == value, (at, key)
