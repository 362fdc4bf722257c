"""Attribution patching is the first-order estimate of patching_sweep: the same shape and
sign, equal to a finite-difference directional derivative, exact where the metric is linear,
close to exact patching for small perturbations."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import handformer as hf
from handformer.inspect import attribution_patching, hooks, patching_sweep, run_with_cache

V = 24


def tiny(seed: int = 0, dtype: torch.dtype = torch.float64) -> hf.CausalLM:
    torch.manual_seed(seed)
    model = hf.CausalLM(hf.CausalLMConfig(vocab_size=V, max_len=16, d_model=16, num_heads=4,
                                          num_layers=3, d_ff=32, positional="rotary"))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.35)
    return model.to(dtype).eval()


def metric(out: object) -> torch.Tensor:
    return out.logits[:, -1, 3].mean() - out.logits[:, -1, 4].mean()


def pair(model: hf.CausalLM, *, nearby: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Clean and corrupted ids differing in one token; with ``nearby`` the corrupted token's
    embedding is moved to within ``nearby`` of the clean one (a small perturbation)."""
    torch.manual_seed(1)
    clean = torch.randint(0, 20, (2, 7))
    clean[:, 2] = 20
    corrupted = clean.clone()
    corrupted[:, 2] = 21
    if nearby is not None:
        with torch.no_grad():
            emb = model.tok_emb.weight
            emb[21] = emb[20] + nearby * torch.randn_like(emb[20])
    return clean, corrupted


HOOKS = ["z", "q", "k", "v", "pattern", "resid_pre", "attn_out", "mlp_out", "resid_post"]


@pytest.mark.parametrize("hook", HOOKS)
def test_close_to_exact_patching_for_a_small_perturbation(hook: str) -> None:
    model = tiny()
    clean, corrupted = pair(model, nearby=0.01)
    estimate = attribution_patching(model, clean, corrupted, metric, hook=hook)
    exact = patching_sweep(model, clean, corrupted, metric, hook=hook)
    assert estimate.shape == exact.shape and estimate.dtype == torch.float64
    r = torch.corrcoef(torch.stack([estimate.flatten(), exact.flatten()]))[0, 1]
    assert r > 0.99, (hook, float(r))
    assert (estimate - exact).abs().max() < 0.05 * exact.abs().max()


def test_equals_a_finite_difference_directional_derivative() -> None:
    """The estimate of patching head (l, h) is d/de metric(z_corr + e * (z_clean - z_corr))
    at e = 0, here by central differences in float64."""
    model = tiny(2)
    clean, corrupted = pair(model, nearby=None)  # a big change: the estimate is not exact
    estimate = attribution_patching(model, clean, corrupted, metric, hook="z")
    _, cache = run_with_cache(model, clean, names="blocks.*.attn.hook_z")
    eps = 1e-5
    for layer, head in [(0, 1), (1, 3), (2, 0)]:
        name = f"blocks.{layer}.attn.hook_z"

        def moved(e: float, name: str = name, head: int = head) -> float:
            def hook(z: torch.Tensor, _: str) -> torch.Tensor:
                z = z.clone()
                z[:, :, head] += e * (cache[name][:, :, head] - z[:, :, head])
                return z
            with torch.no_grad(), hooks(model, {name: hook}):
                return float(metric(model(corrupted)))

        derivative = (moved(eps) - moved(-eps)) / (2 * eps)
        assert estimate[layer, head] == pytest.approx(derivative, rel=1e-6, abs=1e-9)


def test_exact_where_the_metric_is_linear_in_the_activation() -> None:
    """Without the final norm, the last layer's MLP output reaches the logits linearly: there
    the estimate equals exact patching; earlier layers (through nonlinearities) do not."""
    model = tiny(3)
    model.ln_final = nn.Identity()
    clean, corrupted = pair(model, nearby=None)
    estimate = attribution_patching(model, clean, corrupted, metric, hook="mlp_out")
    exact = patching_sweep(model, clean, corrupted, metric, hook="mlp_out")
    torch.testing.assert_close(estimate[-1], exact[-1], atol=1e-10, rtol=1e-10)
    assert (estimate[0] - exact[0]).abs().max() > 1e-4


def test_parameters_get_no_gradients_and_keep_requires_grad() -> None:
    model = tiny(4)
    clean, corrupted = pair(model, nearby=None)
    attribution_patching(model, clean, corrupted, metric)
    assert all(p.grad is None and p.requires_grad for p in model.parameters())


def test_a_list_of_pairs_gives_the_mean() -> None:
    model = tiny(5)
    clean, corrupted = pair(model, nearby=None)
    cleans, corrupts = [clean[:1], clean[1:]], [corrupted[:1], corrupted[1:]]
    together = attribution_patching(model, cleans, corrupts, metric, hook="v")
    alone = torch.stack([attribution_patching(model, c, x, metric, hook="v")
                         for c, x in zip(cleans, corrupts, strict=True)]).mean(0)
    torch.testing.assert_close(together, alone)
    exact = patching_sweep(model, cleans, corrupts, metric, hook="v")
    assert exact.shape == together.shape


def test_bad_inputs() -> None:
    model = tiny()
    clean, corrupted = pair(model, nearby=None)
    with pytest.raises(ValueError, match="hook must be one of"):
        attribution_patching(model, clean, corrupted, metric, hook="embed")
    with pytest.raises(ValueError, match="needs metric\\(output\\) to return one number"):
        attribution_patching(model, clean, corrupted, lambda out: 1.0)
    with pytest.raises(ValueError, match="same shapes"):
        attribution_patching(model, clean, corrupted[:, :5], metric)
    with pytest.raises(ValueError, match="lists of the same length"):
        attribution_patching(model, [clean], [corrupted, corrupted], metric)
