"""TransformerLens' short names on the activation cache: ``cache["pattern", 0, "attn"]``.

The expected full names are the examples of TransformerLens' own ``utils.get_act_name``
docstring (the reference), and every short form an error lists as valid resolves on the model
it was listed for (what the old message broke: it listed ``pattern`` while refusing
``("pattern", 0, "attn")``).
"""

from __future__ import annotations

import ast
import re

import pytest
import torch

import handformer as hf
from handformer.inspect import run_with_cache
from handformer.inspect.act_names import act_name

# (arguments, full name): TransformerLens' get_act_name docstring, then its alias rules
TL_EXAMPLES = [
    (("k", 6, "a"), "blocks.6.attn.hook_k"),
    (("pre", 2), "blocks.2.mlp.hook_pre"),
    (("embed",), "hook_embed"),
    (("normalized", 27, "ln2"), "blocks.27.ln2.hook_normalized"),
    (("k6",), "blocks.6.attn.hook_k"),
    (("scale4ln1",), "blocks.4.ln1.hook_scale"),
    (("pre5",), "blocks.5.mlp.hook_pre"),
    (("pattern", 0, "attn"), "blocks.0.attn.hook_pattern"),
    (("pattern", 0, "attention"), "blocks.0.attn.hook_pattern"),
    (("attn", 1), "blocks.1.attn.hook_pattern"),
    (("attn_logits", 1), "blocks.1.attn.hook_attn_scores"),
    (("query", 1), "blocks.1.attn.hook_q"),
    (("mlp_post", 1), "blocks.1.mlp.hook_post"),
    (("resid_post", 3), "blocks.3.hook_resid_post"),
    (("resid_pre", 3, "b"), "blocks.3.hook_resid_pre"),
    (("scale", 2, "ln1"), "blocks.2.ln1.hook_scale"),
    (("scale",), "ln_final.hook_scale"),
    (("normalized",), "ln_final.hook_normalized"),
    (("blocks.0.hook_resid_pre",), "blocks.0.hook_resid_pre"),
]


@pytest.mark.parametrize(("args", "full"), TL_EXAMPLES)
def test_act_name_follows_transformer_lens(args: tuple, full: str) -> None:
    assert act_name(*args) == full


def test_a_kind_that_contradicts_the_name_is_refused() -> None:
    with pytest.raises(KeyError, match="'pattern' is an attn hook .* kind 'mlp'"):
        act_name("pattern", 0, "mlp")
    with pytest.raises(KeyError, match="layer .* must be an integer, got '0'"):
        act_name("pattern", "0")


def gpt2_like() -> hf.CausalLM:
    return hf.CausalLM(hf.CausalLMConfig(vocab_size=30, max_len=16, d_model=16, num_heads=4,
                                         num_layers=3, d_ff=24))


def llama_like() -> hf.CausalLM:
    return hf.CausalLM(hf.CausalLMConfig(
        vocab_size=30, max_len=16, d_model=16, num_heads=4, num_layers=2, d_ff=24,
        positional="rotary", norm="rms", mlp="gated", activation="silu", num_kv_heads=2,
        qk_norm=True, sandwich_norm=True, bias=False))


def encoder() -> hf.Encoder:
    return hf.Encoder(hf.EncoderLayer(16, 2, 24, dropout=0.0), 2, final_norm=True)


MODELS = {"gpt2": gpt2_like, "llama": llama_like, "encoder": encoder}


def listed_forms(cache: hf.inspect.ActivationCache) -> list[tuple]:
    """The short forms an unknown short name's error lists as this model's."""
    with pytest.raises(KeyError) as info:
        cache["no_such_name", 0]
    listing = str(info.value).split("its short names are ", 1)[1].rstrip("\"'")
    return [ast.literal_eval(form.replace("layer", "0"))
            for form in re.findall(r"\([^)]*\)|'\w+'", listing)]


@pytest.mark.parametrize("which", sorted(MODELS))
def test_every_listed_short_name_resolves(which: str) -> None:
    model = MODELS[which]().eval()
    ids = torch.randint(0, 30, (1, 5)) if which != "encoder" else torch.randn(1, 5, 16)
    _, cache = run_with_cache(model, ids)
    forms = listed_forms(cache)
    assert len(forms) >= 10
    resolved = set()
    for form in forms:
        key = form if isinstance(form, tuple) else (form,)
        value = cache[key] if len(key) > 1 else cache[key[0]]
        assert isinstance(value, torch.Tensor)
        if len(key) > 1:  # the last layer too, by a negative index
            last = (key[0], -1, *key[2:])
            assert cache[last] is cache[(key[0], cache.num_layers - 1, *key[2:])]
        resolved.add(id(value))
    assert len(resolved) == len(forms)  # each form reaches its own hook point
    # every per-layer hook point of block 0 that has a short form was listed
    assert ("pattern", 0) in forms and ("resid_post", 0) in forms


def test_transformer_lens_tuple_forms_on_a_cache() -> None:
    _, cache = run_with_cache(gpt2_like(), torch.randint(0, 30, (1, 5)))
    assert cache["pattern", 0] is cache["blocks.0.attn.hook_pattern"]
    assert cache["pattern", 0, "attn"] is cache["blocks.0.attn.hook_pattern"]
    assert cache["pattern", 0, "a"] is cache["blocks.0.attn.hook_pattern"]
    assert cache["resid_post", 2] is cache["blocks.2.hook_resid_post"]
    assert cache["scale", 2, "ln1"] is cache["blocks.2.ln1.hook_scale"]
    assert cache["scale", -1, "ln2"] is cache["blocks.2.ln2.hook_scale"]
    assert cache["k1"] is cache["blocks.1.attn.hook_k"]
    assert cache["embed"] is cache["hook_embed"]
    assert cache["scale"] is cache["ln_final.hook_scale"]
    with pytest.raises(KeyError, match=r"give the layer, e.g. cache\['pattern', 0\]"):
        cache["pattern"]
    with pytest.raises(KeyError, match="'pattern' is an attn hook"):
        cache["pattern", 0, "mlp"]
    with pytest.raises(KeyError, match="was not kept"):
        run_with_cache(gpt2_like(), torch.randint(0, 30, (1, 5)),
                       names="hook_embed")[1]["pattern", 0, "attn"]
