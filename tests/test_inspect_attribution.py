"""Direct logit attribution adds up: decompose_resid / stack_head_results through logit_attrs,
plus the bias term, give the logit (difference) that the model computed."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import handformer as hf
from handformer.inspect import attribution, run_with_cache

V = 41


def gpt2_shaped(*, seed: int = 0, dtype: torch.dtype = torch.float64, layers: int = 3,
                heads: int = 4) -> hf.CausalLM:
    """A tiny GPT-2-shaped model (LayerNorm with biases, learned positions) with large random
    weights, so that every term matters."""
    torch.manual_seed(seed)
    model = hf.CausalLM(hf.CausalLMConfig(vocab_size=V, max_len=32, d_model=16,
                                          num_heads=heads, num_layers=layers, d_ff=32,
                                          tie_weights=False))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.4)
    return model.to(dtype).eval()


def logit_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``(B,)`` logits of the last position at ``tokens`` ``(B,)``."""
    return logits[:, -1].gather(1, tokens[:, None])[:, 0]


@pytest.mark.parametrize("how", ["decompose", "heads"])
def test_attributions_add_up_to_the_logit_difference(how: str) -> None:
    model = gpt2_shaped()
    ids = torch.randint(0, V, (3, 9))
    out, cache = run_with_cache(model, ids)
    right, wrong = torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])
    stack = (cache.decompose_resid(pos_slice=-1, return_labels=True) if how == "decompose"
             else cache.stack_head_results(pos_slice=-1, incl_remainder=True,
                                           return_labels=True))
    attrs, labels = cache.logit_attrs(stack, right, wrong, pos_slice=-1, incl_bias=True)
    assert labels[-1] == "bias" and len(labels) == attrs.shape[0]
    if how == "heads":
        assert labels[:5] == ["L0H0", "L0H1", "L0H2", "L0H3", "L1H0"]
        assert labels[-2] == "remainder" and attrs.shape[0] == 3 * 4 + 2
    else:
        assert labels[:4] == ["embed", "pos_embed", "0_attn_out", "0_mlp_out"]
    expected = logit_of(out.logits, right) - logit_of(out.logits, wrong)
    torch.testing.assert_close(attrs.sum(0), expected, atol=1e-10, rtol=1e-10)
    # the bias term matters: without it the sum is off
    assert (attrs[:-1].sum(0) - expected).abs().max() > 1e-3


def test_every_position_and_token_adds_up_and_layernorm_centring_matters() -> None:
    model = gpt2_shaped(seed=1)
    ids = torch.randint(0, V, (2, 7))
    out, cache = run_with_cache(model, ids)
    stack = cache.decompose_resid()  # (C, B, L, E)
    for token in (0, 17, V - 1):
        attrs = cache.logit_attrs(stack, token, incl_bias=True)  # (C + 1, B, L)
        torch.testing.assert_close(attrs.sum(0), out.logits[..., token], atol=1e-10,
                                   rtol=1e-10)
    # (B, L) tokens: one per position
    tokens = torch.randint(0, V, (2, 7))
    attrs = cache.logit_attrs(stack, tokens, incl_bias=True)
    torch.testing.assert_close(attrs.sum(0), out.logits.gather(2, tokens[..., None])[..., 0])
    # without centring each component (as for RMSNorm) the sum is wrong for a LayerNorm model
    scale = attribution._divisor(cache["resid_post", -1], model.ln_final)
    uncentred = (stack / scale * attribution.tokens_to_residual_directions(model, 5)).sum(-1)
    bias = cache.logit_bias(5)
    assert (uncentred.sum(0) + bias - out.logits[..., 5]).abs().max() > 1e-3


def test_heads_of_a_layer_add_up_to_attn_out_minus_the_output_bias() -> None:
    model = gpt2_shaped(seed=2)
    ids = torch.randint(0, V, (2, 6))
    _, cache = run_with_cache(model, ids)
    heads, labels = cache.stack_head_results(return_labels=True)
    H = 4
    for layer in range(3):
        block = heads[layer * H:(layer + 1) * H].sum(0)
        expected = cache["attn_out", layer] - model.blocks[layer].attn.out_proj.bias
        torch.testing.assert_close(block, expected, atol=1e-10, rtol=1e-10)
    # layer=2: heads of layers 0 and 1, remainder = resid_pre of layer 2 minus them
    part, labels = cache.stack_head_results(2, incl_remainder=True, return_labels=True)
    assert len(labels) == 2 * H + 1
    torch.testing.assert_close(part.sum(0), cache["resid_pre", 2])


def test_cached_scale_and_recomputed_scale_agree_and_lens_is_not_additive() -> None:
    model = gpt2_shaped(seed=3)
    ids = torch.randint(0, V, (2, 6))
    out, cache = run_with_cache(model, ids)
    _, partial = run_with_cache(model, ids, names="blocks.*.hook_*")  # no final-norm scale
    stack = cache.decompose_resid()
    torch.testing.assert_close(cache.apply_ln_to_stack(stack), partial.apply_ln_to_stack(stack))
    acc, labels = cache.accumulated_resid(apply_ln=True, return_labels=True)
    assert labels == ["0_pre", "1_pre", "2_pre", "final_post"]
    # the last lens entry, through the norm's weight and bias and the head, is the logits
    norm = model.ln_final
    lens_logits = model.lm_head(acc[-1] * norm.weight + norm.bias)
    torch.testing.assert_close(lens_logits, out.logits)
    # each lens entry is normalised by its own divisor: unit RMS after centring
    torch.testing.assert_close(acc.pow(2).mean(-1), torch.ones(acc.shape[:-1], dtype=acc.dtype),
                               atol=1e-3, rtol=1e-3)
    mid, labels = cache.accumulated_resid(1, incl_mid=True, mlp_input=True, return_labels=True)
    assert labels == ["0_pre", "0_mid", "1_pre", "1_mid"]


def test_decompose_modes_and_labels() -> None:
    model = gpt2_shaped(seed=4, layers=2)
    _, cache = run_with_cache(model, torch.randint(0, V, (1, 5)))
    _, labels = cache.decompose_resid(mode="attn", incl_embeds=False, return_labels=True)
    assert labels == ["0_attn_out", "1_attn_out"]
    _, labels = cache.decompose_resid(1, mlp_input=True, return_labels=True)
    assert labels == ["embed", "pos_embed", "0_attn_out", "0_mlp_out", "1_attn_out"]
    stack = cache.decompose_resid(1, mlp_input=True)
    torch.testing.assert_close(stack.sum(0), cache["resid_mid", 1])
    with pytest.raises(ValueError, match="mode must be one of"):
        cache.decompose_resid(mode="heads")


def test_negative_layer_indices_and_short_names() -> None:
    model = gpt2_shaped(seed=5, layers=3)
    _, cache = run_with_cache(model, torch.randint(0, V, (1, 5)))
    assert cache["pattern", -1] is cache["blocks.2.attn.hook_pattern"]
    assert cache["resid_pre", -3] is cache["blocks.0.hook_resid_pre"]
    with pytest.raises(KeyError, match="layer -4 is out of range: the model has 3 layers"):
        cache["pattern", -4]
    assert cache.model is model and cache.num_layers == 3


def test_matches_transformers_gpt2_logits(tmp_path: Path) -> None:
    """On a GPT-2 folder written by transformers, the attributions add up to *its* logits."""
    transformers = pytest.importorskip("transformers")
    from handformer.pretrained import load_gpt2

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=24, n_layer=2,
                                     n_head=3, initializer_range=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = transformers.GPT2LMHeadModel(config).eval()
        for name, p in reference.named_parameters():  # non-trivial LN weights and biases
            if "ln_" in name:
                torch.nn.init.normal_(p, mean=0.5 if name.endswith("weight") else 0.0, std=0.3)
        reference.save_pretrained(tmp_path, safe_serialization=True)
        model, _ = load_gpt2(tmp_path)
    ids = torch.randint(0, V, (2, 8))
    with torch.no_grad():
        expected = reference(ids).logits[:, -1]  # (B, V)
    _, cache = run_with_cache(model, ids)
    heads = cache.stack_head_results(pos_slice=-1, incl_remainder=True)
    for token in (3, 11):
        attrs = cache.logit_attrs(heads, token, pos_slice=-1, incl_bias=True)
        torch.testing.assert_close(attrs.sum(0), expected[:, token], atol=2e-5, rtol=1e-5)


def test_bad_inputs() -> None:
    model = gpt2_shaped(seed=6, layers=1)
    _, cache = run_with_cache(model, torch.randint(0, V, (1, 4)))
    stack = cache.decompose_resid(pos_slice=-1)
    with pytest.raises(TypeError, match="must be token ids"):
        cache.logit_attrs(stack, " Paris", pos_slice=-1)
    with pytest.raises(ValueError, match=r"must be token ids in \[0, 41\)"):
        cache.logit_attrs(stack, 41, pos_slice=-1)
    with pytest.raises(ValueError, match="same shape"):
        cache.logit_attrs(stack, torch.tensor([1]), torch.tensor([1, 2]), pos_slice=-1)
    with pytest.raises(ValueError, match=r"layer must be in 0\.\.1"):
        cache.decompose_resid(2)
    post = hf.CausalLM(hf.CausalLMConfig(vocab_size=V, max_len=8, d_model=8, num_heads=2,
                                         num_layers=1, d_ff=8, norm_first=False)).eval()
    _, cache = run_with_cache(post, torch.randint(0, V, (1, 4)))
    with pytest.raises(ValueError, match="needs a pre-norm model"):
        cache.decompose_resid()


def modern(*, gemma: bool, seed: int = 7) -> hf.CausalLM:
    """A tiny Llama-shaped (RMSNorm, gated SiLU MLP, GQA, RoPE, no biases) or Gemma-shaped
    (RMSNorm with 1 + w, sandwich norms, embedding scale, QK-norm, soft-caps, GQA) model."""
    options = dict(vocab_size=V, max_len=32, d_model=16, num_heads=4, num_kv_heads=2,
                   num_layers=3, d_ff=32, positional="rotary", norm="rms", mlp="gated",
                   activation="silu", bias=False, tie_weights=False)
    if gemma:
        options.update(norm_offset=1.0, sandwich_norm=True, embed_scale=4.0, qk_norm=True,
                       attn_softcap=20.0, final_softcap=3.0, activation="gelu_tanh",
                       tie_weights=True)
    torch.manual_seed(seed)
    model = hf.CausalLM(hf.CausalLMConfig(**options))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.4)
    return model.double().eval()


def pre_cap_logits(model: hf.CausalLM, cache: object) -> torch.Tensor:
    """The logits before the final soft-cap, from the final stream through the modules."""
    return model.lm_head(model.ln_final(cache["resid_post", -1]))


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_modern_models_add_up(gemma: bool) -> None:
    model = modern(gemma=gemma)
    ids = torch.randint(0, V, (2, 8))
    out, cache = run_with_cache(model, ids)
    logits = pre_cap_logits(model, cache)
    if not gemma:
        torch.testing.assert_close(logits, out.logits)
    for stack in (cache.decompose_resid(return_labels=True),
                  cache.stack_head_results(incl_remainder=True, return_labels=True)):
        attrs, labels = cache.logit_attrs(stack, torch.tensor([3, 9]), torch.tensor([5, 1]),
                                          incl_bias=True)
        expected = torch.stack([logits[0, :, 3] - logits[0, :, 5],
                                logits[1, :, 9] - logits[1, :, 1]])
        torch.testing.assert_close(attrs.sum(0), expected, atol=1e-10, rtol=1e-10)
        assert labels[-1] == "bias" and float(attrs[-1].abs().max()) == 0.0  # no biases
    if gemma:
        # the model's own logits are capped: the attributions are of the logit before the cap
        assert (out.logits - logits).abs().max() > 0.1
        torch.testing.assert_close(out.logits, 3.0 * torch.tanh(logits / 3.0))


def test_gemma_heads_add_up_to_attn_out_through_the_frozen_post_norm() -> None:
    model = modern(gemma=True, seed=8)
    _, cache = run_with_cache(model, torch.randint(0, V, (2, 6)))
    _, no_scale = run_with_cache(model, torch.randint(0, V, (2, 6)),
                                 names=lambda n: "ln1_post" not in n)
    heads = cache.stack_head_results()
    for layer in range(3):
        torch.testing.assert_close(heads[layer * 4:(layer + 1) * 4].sum(0),
                                   cache["attn_out", layer], atol=1e-10, rtol=1e-10)
    # without the cached post-norm divisor it is recomputed from the heads' sum: the same
    again = no_scale.stack_head_results()
    for layer in range(3):
        torch.testing.assert_close(again[layer * 4:(layer + 1) * 4].sum(0),
                                   no_scale["attn_out", layer], atol=1e-10, rtol=1e-10)
    # the raw head results (before the post-norm) do not add up to attn_out
    raw = cache["result", 0].sum(2)
    assert (raw - cache["attn_out", 0]).abs().max() > 1e-2


def test_gemma_direction_uses_one_plus_w() -> None:
    """The unit offset of Gemma's norm is part of the direction: with w alone it is wrong."""
    model = modern(gemma=True, seed=9)
    _, cache = run_with_cache(model, torch.randint(0, V, (1, 5)))
    stack = cache.decompose_resid(pos_slice=-1)
    logits = pre_cap_logits(model, cache)[:, -1]
    attrs = cache.logit_attrs(stack, 4, pos_slice=-1, incl_bias=True)
    torch.testing.assert_close(attrs.sum(0), logits[:, 4], atol=1e-10, rtol=1e-10)
    scaled = cache.apply_ln_to_stack(stack, pos_slice=-1)
    without_offset = (scaled * model.lm_head.weight[4] * model.ln_final.weight).sum(-1).sum(0)
    assert (without_offset - logits[:, 4]).abs().max() > 1e-2
    assert model.ln_final.offset == 1.0


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_head_results_from_hook_z_equal_the_cached_hook_result(gemma: bool) -> None:
    model = modern(gemma=gemma, seed=10)
    ids = torch.randint(0, V, (2, 6))
    _, full = run_with_cache(model, ids)
    _, no_result = run_with_cache(model, ids, names=lambda n: not n.endswith("hook_result"))
    assert "blocks.0.attn.hook_result" in full and "blocks.0.attn.hook_result" not in no_result
    torch.testing.assert_close(no_result.stack_head_results(pos_slice=[1, 5]),
                               full.stack_head_results(pos_slice=[1, 5]))


@pytest.mark.parametrize("pos_slice", [-1, slice(2, 5), [0, 6]], ids=["int", "slice", "list"])
def test_position_slices_add_up_with_and_without_the_cached_post_norm_scale(pos_slice) -> None:
    model = modern(gemma=True, seed=11)
    ids = torch.randint(0, V, (2, 7))
    _, cache = run_with_cache(model, ids)
    _, without = run_with_cache(model, ids, names=lambda n: "ln1_post" not in n)
    expected = pre_cap_logits(model, cache)[:, pos_slice, 4]
    for c in (cache, without):
        stack = c.stack_head_results(pos_slice=pos_slice, incl_remainder=True)
        attrs = c.logit_attrs(stack, 4, pos_slice=pos_slice, incl_bias=True)
        torch.testing.assert_close(attrs.sum(0), expected, atol=1e-10, rtol=1e-10)
