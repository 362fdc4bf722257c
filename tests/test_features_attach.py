"""Splicing dictionaries into models: with the error term the model's output is its own, without
it the model runs on the reconstruction (checked against the same edit made by hand with a
plain hook), features for every position come through run_with_cache, a feature ablated with
the existing hook API moves the output by exactly its decoder row, transcoders replace an MLP
from its input, several splices at once, and the refusals."""

from __future__ import annotations

import copy

import pytest
import torch

import handformer as hf
from handformer.features import SparseAutoencoder, Transcoder, attach, detach, splices
from handformer.inspect import hook_names, run_with_cache, run_with_hooks
from handformer.models.plain_step import plain_step_refusal

V, E = 23, 16


def tiny(*, gemma: bool = False, seed: int = 0) -> hf.CausalLM:
    """A tiny RMSNorm, gated-MLP model (sandwich norms and soft-caps with ``gemma``)."""
    options = dict(vocab_size=V, max_len=32, d_model=E, num_heads=4, num_kv_heads=2,
                   num_layers=3, d_ff=32, positional="rotary", norm="rms", mlp="gated",
                   activation="silu", bias=False, norm_first=True)
    if gemma:
        options.update(norm_offset=1.0, sandwich_norm=True, embed_scale=4.0, qk_norm=True,
                       final_softcap=3.0, activation="gelu_tanh")
    torch.manual_seed(seed)
    model = hf.CausalLM(hf.CausalLMConfig(**options))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model.eval()


def dictionary(kind="sae", *, d_in=E, activation="relu", seed=1, **options):
    torch.manual_seed(seed)
    if kind == "sae":
        d = SparseAutoencoder(d_in, 64, activation=activation, **options)
    else:
        d = Transcoder(d_in, 64, activation=activation, **options)
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(std=0.3)
        if d.threshold is not None:
            d.threshold.fill_(0.05)
    return d


IDS = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("activation", ["relu", "topk", "jumprelu"])
def test_spliced_with_the_error_term_is_the_model_itself(gemma, activation):
    model = tiny(gemma=gemma)
    base = model(IDS).logits
    k = 5 if activation == "topk" else None
    sae = dictionary(activation=activation, k=k)
    with attach(model, sae, at="blocks.1.hook_resid_post"):
        plain = model(IDS).logits
        out, cache = run_with_cache(model, IDS)  # every hook point listens, features included
    out_ref, cache_ref = run_with_cache(model, IDS)  # the same kernels as the cached run
    assert (plain - base).abs().max() <= 1e-6
    assert (out.logits - out_ref.logits).abs().max() <= 1e-6
    acts = cache["blocks.1.hook_resid_post.hook_sae_acts_post"]
    assert acts.shape == (2, 9, 64)  # every position
    x = cache_ref["blocks.1.hook_resid_post"]
    torch.testing.assert_close(acts, sae.encode(x))
    torch.testing.assert_close(cache["blocks.1.hook_resid_post.hook_sae_recons"], sae(x))
    torch.testing.assert_close(cache["blocks.1.hook_resid_post.hook_sae_error"], x - sae(x))
    # the splice is gone after the block
    assert not any("hook_sae" in n for n in hook_names(model))
    assert torch.equal(model(IDS).logits, base)


def test_without_the_error_term_the_model_runs_on_the_reconstruction():
    model = tiny()
    sae = dictionary()
    with attach(model, sae, at="blocks.1.hook_resid_post", with_error=False):
        spliced = model(IDS).logits
    by_hand = run_with_hooks(model, IDS, hooks={
        "blocks.1.hook_resid_post": lambda x, name: sae(x).detach()}).logits
    torch.testing.assert_close(spliced, by_hand, rtol=0, atol=1e-6)
    assert (spliced - model(IDS).logits).abs().max() > 1e-2  # it loses something


def test_ablating_a_feature_moves_the_activation_by_its_decoder_row():
    """Zeroing feature f through the existing hook API (run_with_hooks on
    hook_sae_acts_post) equals replacing the activation by x - acts[f] * W_dec[f] by hand."""
    model = tiny()
    sae = dictionary(apply_b_dec_to_input=True)
    _, cache = run_with_cache(model, IDS, names="blocks.1.hook_resid_post")
    acts = sae.encode(cache["blocks.1.hook_resid_post"]).detach()
    f = int(acts.sum((0, 1)).argmax())  # an active feature

    def zero(t, name):
        t = t.clone()
        t[..., f] = 0
        return t

    with attach(model, sae, at="blocks.1.hook_resid_post"):
        ablated = run_with_hooks(model, IDS, hooks={
            "blocks.1.hook_resid_post.hook_sae_acts_post": zero}).logits
    by_hand = run_with_hooks(model, IDS, hooks={
        "blocks.1.hook_resid_post":
            lambda x, name: (x - acts[..., f:f + 1] * sae.W_dec[f]).detach()}).logits
    torch.testing.assert_close(ablated, by_hand, rtol=0, atol=1e-5)
    assert (ablated - model(IDS).logits).abs().max() > 1e-3


@pytest.mark.parametrize("gemma", [False, True])
def test_a_transcoder_replaces_the_mlp_from_its_input(gemma):
    model = tiny(gemma=gemma)
    base = model(IDS).logits
    tc = dictionary("transcoder", skip=True)
    _, cache = run_with_cache(model, IDS, names="blocks.2.hook_resid_mid")  # plain kernels
    layer = model.blocks[2]
    mlp_in = layer.ln2(cache["blocks.2.hook_resid_mid"]).detach()
    with attach(model, tc, at="blocks.2.mlp") as splice:
        assert "blocks.2.mlp.hook_in" in hook_names(model)
        assert (model(IDS).logits - base).abs().max() <= 1e-6
        out, spliced = run_with_cache(model, IDS)
        assert splice.names()[0] == "blocks.2.hook_mlp_out.hook_sae_input"
    out_ref, _ = run_with_cache(model, IDS)
    assert (out.logits - out_ref.logits).abs().max() <= 1e-6
    torch.testing.assert_close(spliced["blocks.2.hook_mlp_out.hook_sae_input"], mlp_in)
    torch.testing.assert_close(spliced["blocks.2.hook_mlp_out.hook_sae_acts_post"],
                               tc.encode(mlp_in))
    with attach(model, tc, at="blocks.2.mlp", with_error=False):
        replaced = model(IDS).logits
    by_hand = run_with_hooks(model, IDS, hooks={
        "blocks.2.hook_mlp_out": lambda y, name: tc(mlp_in).detach()}).logits
    torch.testing.assert_close(replaced, by_hand, rtol=0, atol=1e-6)
    assert "blocks.2.mlp.hook_in" not in hook_names(model)  # gone with the splice


def test_transcoder_at_named_points_and_the_ln2_alias():
    model = tiny()
    tc = dictionary("transcoder")
    _, cache = run_with_cache(model, IDS, names="blocks.0.hook_resid_mid")
    with attach(model, tc, at=("blocks.0.hook_resid_mid", "blocks.0.hook_mlp_out"),
                with_error=False):
        mid = model(IDS).logits
    by_hand = run_with_hooks(model, IDS, hooks={
        "blocks.0.hook_mlp_out":
            lambda y, name: tc(cache["blocks.0.hook_resid_mid"]).detach()}).logits
    torch.testing.assert_close(mid, by_hand, rtol=0, atol=1e-6)
    tc.hook_name, tc.output_hook_name = "blocks.0.ln2.hook_normalized", "blocks.0.hook_mlp_out"
    with attach(model, tc) as splice:  # the TransformerLens name of the MLP's input
        assert "blocks.0.mlp.hook_in" in splice.points


def test_every_layer_at_once_and_permanent_until_removed():
    model = tiny()
    base = model(IDS).logits
    state = sorted(model.state_dict())
    saes = [dictionary(seed=i, hook_name=f"blocks.{i}.hook_resid_post") for i in range(3)]
    handle = attach(model, saes, with_error=False)
    assert splices(model) == [handle]
    assert sorted(model.state_dict()) == state  # the dictionaries are not model parameters
    spliced = model(IDS).logits
    _, cache = run_with_cache(model, IDS, names="blocks.*.hook_resid_post.hook_sae_acts_post")
    assert len(cache) == 3
    assert detach(model) == 1 and handle.removed and splices(model) == []
    assert torch.equal(model(IDS).logits, base)

    def chain(i):
        return lambda x, name: saes[i](x).detach()
    by_hand = run_with_hooks(model, IDS, hooks={
        f"blocks.{i}.hook_resid_post": chain(i) for i in range(3)}).logits
    torch.testing.assert_close(spliced, by_hand, rtol=0, atol=1e-6)
    handle.remove()  # idempotent


def test_generate_runs_through_the_splice():
    model = tiny()
    sae = dictionary(hook_name="blocks.2.hook_resid_post")
    prompt = IDS[:1, :4]
    with attach(model, sae, with_error=False):
        assert plain_step_refusal(model, model.new_cache(capacity=8)) is not None
        out = model.generate(prompt, max_new_tokens=5)
        ids = prompt
        for _ in range(5):  # greedy, no cache: the reference
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ids)


def test_refusals():
    model = tiny()
    with pytest.raises(ValueError, match=r"d_in = 8 does not fit 'blocks.1.hook_resid_post' "
                                         r"of this model \(width 16\)"):
        attach(model, dictionary(d_in=8), at="blocks.1.hook_resid_post")
    with pytest.raises(KeyError, match="unknown hook name 'blocks.1.hook_resid_pots'"):
        attach(model, dictionary(), at="blocks.1.hook_resid_pots")
    sae = dictionary(hook_name="blocks.0.hook_resid_post")
    with pytest.raises(ValueError, match="trained on 'blocks.0.hook_resid_post'"):
        attach(model, sae, at="blocks.1.hook_resid_post")
    with attach(model, sae):
        with pytest.raises(ValueError, match="spliced already"):
            attach(model, sae)
        with pytest.raises(ValueError, match="has a dictionary spliced already"):
            attach(model, copy.deepcopy(sae))
    with pytest.raises(ValueError, match="at is needed"):
        attach(model, dictionary())
    with pytest.raises(ValueError, match="at for a Transcoder must be"):
        attach(model, dictionary("transcoder"), at="blocks.0.hook_mlp_out")
    with pytest.raises(TypeError, match="dictionary must be"):
        attach(model, "sae.safetensors")
    # an attention-output hook's width is checked when the model runs, naming both
    with attach(model, dictionary(d_in=8), at="blocks.0.attn.hook_z"):
        with pytest.raises(ValueError, match="d_in = 8 does not fit 'blocks.0.attn.hook_z'"):
            model(IDS)
    assert not splices(model)


def test_patching_a_feature_from_a_clean_run():
    """Activation patching on a feature with the existing API: cache the clean run's feature
    activations, put one feature at one position into the corrupted run; the output moves by
    exactly that feature's decoder row times the change in its activation."""
    model = tiny()
    sae = dictionary(hook_name="blocks.1.hook_resid_post")
    clean, corrupted = IDS[:1], IDS[1:]
    name = "blocks.1.hook_resid_post.hook_sae_acts_post"
    with attach(model, sae):
        _, clean_cache = run_with_cache(model, clean, names=name)
        _, corrupt_cache = run_with_cache(model, corrupted, names=name)
        delta = clean_cache[name] - corrupt_cache[name]  # (1, 9, 64)
        pos, f = divmod(int(delta.abs().flatten().argmax()), 64)

        def patch(acts, name):
            acts = acts.clone()
            acts[:, pos, f] = clean_cache[name][:, pos, f]
            return acts

        patched = run_with_hooks(model, corrupted, hooks={name: patch}).logits
    _, resid = run_with_cache(model, corrupted, names="blocks.1.hook_resid_post")
    shift = torch.zeros_like(resid["blocks.1.hook_resid_post"])
    shift[:, pos] = delta[:, pos, f, None] * sae.W_dec[f].detach()
    by_hand = run_with_hooks(model, corrupted, hooks={
        "blocks.1.hook_resid_post": lambda x, name: x + shift}).logits
    torch.testing.assert_close(patched, by_hand, rtol=0, atol=1e-5)
    assert (patched - model(corrupted).logits).abs().max() > 1e-4


def test_an_sae_on_the_mlp_modules_output():
    """blocks.{i}.mlp.hook_out (sparsify's ``layers.i.mlp``) exists while spliced: on a model
    without a post-MLP norm it is hook_mlp_out's value."""
    model = tiny()
    sae = dictionary(hook_name="blocks.0.mlp.hook_out")
    with attach(model, sae, with_error=False):
        assert "blocks.0.mlp.hook_out.hook_sae_acts_post" in hook_names(model)
        spliced = model(IDS).logits
    assert "blocks.0.mlp.hook_out" not in hook_names(model)
    by_hand = run_with_hooks(model, IDS, hooks={
        "blocks.0.hook_mlp_out": lambda y, name: sae(y).detach()}).logits
    torch.testing.assert_close(spliced, by_hand, rtol=0, atol=1e-6)
