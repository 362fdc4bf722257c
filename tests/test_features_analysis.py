"""Using features (handformer.features.analysis): logit effects against a hand computation,
feature cards (density, histogram, top contexts) against a brute-force pass, steering inside
generate, feature ablation and patching sweeps."""

from __future__ import annotations

import torch

import handformer as hf
from handformer.features import SparseAutoencoder
from handformer.features.analysis import (
    feature_ablation_sweep,
    feature_cards,
    feature_logit_effects,
    feature_patching_sweep,
    steer,
)
from handformer.inspect import run_with_cache

AT = "blocks.1.hook_resid_post"


def setup(norm: str = "rms") -> tuple[hf.CausalLM, SparseAutoencoder]:
    torch.manual_seed(0)
    lm = hf.CausalLM(hf.CausalLMConfig(vocab_size=40, max_len=48, d_model=16, num_heads=2,
                                       num_layers=2, d_ff=32, norm=norm,
                                       positional="rotary")).eval()
    with torch.no_grad():
        if lm.ln_final.weight is not None:
            lm.ln_final.weight.copy_(1 + 0.5 * torch.randn(16))
    sae = SparseAutoencoder(16, 24, activation="relu", hook_name=AT)
    with torch.no_grad():
        sae.b_enc.copy_(0.2 * torch.randn(24))
    return lm, sae


def test_logit_effects_are_the_decoder_row_through_norm_weight_and_unembedding() -> None:
    for norm in ("rms", "layer"):
        lm, sae = setup(norm)
        got = feature_logit_effects(lm, sae, 5, k=4)
        d = sae.W_dec[5].double()
        if norm == "layer":
            d = d - d.mean()
        by_hand = (lm.lm_head.weight.double() * lm.ln_final.weight.double()) @ d  # (V,)
        order = by_hand.argsort(descending=True)
        assert got.top_ids.tolist() == order[:4].tolist()
        assert got.bottom_ids.tolist() == order.flip(0)[:4].tolist()
        torch.testing.assert_close(got.top_values.double(), by_hand[order[:4]], rtol=1e-5,
                                   atol=1e-6)


@torch.no_grad()
def test_feature_cards_match_a_brute_force_pass() -> None:
    lm, sae = setup()
    ids = torch.randint(0, 40, (4000,), generator=torch.Generator().manual_seed(0))
    from handformer.features.stream import TokenWindows

    windows = TokenWindows(ids, 16, bos=None, seed=3)
    batches = torch.cat([windows.batch(s, 8) for s in range(3)])  # (24, 16)
    _, cache = run_with_cache(lm, batches, names=AT)
    z = sae.encode(cache[AT][:, 1:])  # (24, 15, S)
    feats = (z > 0).double().mean((0, 1)).argsort(descending=True)[[0, 3]].tolist()
    cards = feature_cards(lm, sae, windows, feats, tokens=15 * 8 * 3, batch=8, k=3, bins=5)
    for card, f in zip(cards, feats, strict=True):
        acts = z[..., f]
        assert card.tokens == 24 * 15
        assert abs(card.density - float((acts > 0).double().mean())) < 1e-12
        assert int(card.histogram.sum()) == int((acts > 0).sum())
        assert abs(float(card.edges[-1]) - float(acts.max())) < 1e-5
        top = acts.reshape(-1).topk(3)
        assert [round(c.activation, 4) for c in card.contexts] == [
            round(float(v), 4) for v in top.values]
        c = card.contexts[0]
        w, p = divmod(int(top.indices[0]), 15)
        assert c.ids == batches[w].tolist() and c.position == p + 1
        assert c.marked().count("⟦") == 1 and c.token == str(int(batches[w, p + 1]))


def test_steering_adds_the_decoder_row_and_steers_generate() -> None:
    lm, sae = setup()
    ids = torch.randint(0, 40, (1, 6), generator=torch.Generator().manual_seed(1))
    _, clean = run_with_cache(lm, ids, names=AT)
    with steer(lm, sae, 3, 4.0):
        _, steered = run_with_cache(lm, ids, names=AT)
        out = lm.generate(ids, max_new_tokens=5, do_sample=False)
    torch.testing.assert_close(steered[AT], clean[AT] + 4.0 * sae.W_dec[3].detach())
    plain = lm.generate(ids, max_new_tokens=5, do_sample=False)
    # the same steering by hand, on the modules' path
    from handformer.inspect import hooks

    with hooks(lm, {AT: lambda t, n: t + 4.0 * sae.W_dec[3].detach()}):
        by_hand = lm.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(out, by_hand)
    big = 40.0 * sae.W_dec[3].detach() / sae.W_dec[3].norm()
    with hooks(lm, {AT: lambda t, n: t + big}):
        pushed = lm.generate(ids, max_new_tokens=5, do_sample=False)
    assert not torch.equal(pushed, plain)  # a strong push changes the text


@torch.no_grad()
def test_feature_ablation_and_patching_sweeps() -> None:
    lm, sae = setup()
    ids = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(2))
    other = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(3))
    metric = lambda out: out.logits[:, -1, 5].mean()  # noqa: E731
    feats = [0, 4, 9]
    got = feature_ablation_sweep(lm, sae, ids, metric, features=feats, batch_size=2)
    _, cache = run_with_cache(lm, ids, names=AT)
    z = sae.encode(cache[AT])
    clean = float(metric(lm(ids)))
    for f, delta in zip(feats, got.tolist(), strict=True):
        # zeroing feature f inside the splice removes acts[f] * W_dec[f] from the activation
        from handformer.inspect import run_with_hooks

        edited = run_with_hooks(lm, ids, hooks={AT: lambda t, n, f=f: t - z[..., f:f + 1]
                                                * sae.W_dec[f]})
        assert abs(delta - (float(metric(edited)) - clean)) < 1e-5
    patched = feature_patching_sweep(lm, sae, ids, other, metric, features=feats)
    _, cache_other = run_with_cache(lm, other, names=AT)
    z_other = sae.encode(cache_other[AT])
    base = float(metric(lm(other)))
    for f, delta in zip(feats, patched.tolist(), strict=True):
        from handformer.inspect import run_with_hooks

        edited = run_with_hooks(lm, other, hooks={AT: lambda t, n, f=f: t + (
            z[..., f:f + 1] - z_other[..., f:f + 1]) * sae.W_dec[f]})
        assert abs(delta - (float(metric(edited)) - base)) < 1e-5
