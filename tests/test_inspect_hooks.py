"""Hook points and the activation cache against independent references.

BERT and GPT-2: cached residuals and patterns = transformers' output_hidden_states /
output_attentions. A float64 Encoder: q/k/v/scores/pattern/z = a hand computation. Every
attention kind: the explicit path (taken while a hook listens) = the efficient path.
"""

from __future__ import annotations

import math
import threading
import warnings
from pathlib import Path

import pytest
import torch

import handformer as hf
from handformer.inspect import HookError, hook_names, hooks, run_with_cache, run_with_hooks
from handformer.pretrained import load_bert, load_gpt2
from pretrained_util import tiny_checkpoint

transformers = pytest.importorskip("transformers")
ATOL = 1e-5


def padded_batch(vocab: int = 64) -> dict[str, torch.Tensor]:
    ids = torch.randint(5, vocab, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    return {"input_ids": ids * mask, "attention_mask": mask}


def test_bert_cache_equals_transformers_hidden_states_and_attentions(tmp_path: Path) -> None:
    ref = tiny_checkpoint(tmp_path, layers=3)
    model, _ = load_bert(tmp_path)
    enc = padded_batch()
    with torch.no_grad():
        out, cache = run_with_cache(model, enc)
        want = ref(**enc, output_hidden_states=True, output_attentions=True)
    assert len(want.hidden_states) == 4
    torch.testing.assert_close(cache["blocks.0.hook_resid_pre"], want.hidden_states[0],
                               atol=ATOL, rtol=0)
    for i in range(3):
        torch.testing.assert_close(cache[f"blocks.{i}.hook_resid_post"],
                                   want.hidden_states[i + 1], atol=ATOL, rtol=0)
        torch.testing.assert_close(cache[f"blocks.{i}.attn.hook_pattern"],
                                   want.attentions[i], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.last_hidden_state, want.last_hidden_state, atol=ATOL, rtol=0)
    # the word embeddings are the table rows
    torch.testing.assert_close(cache["hook_embed"],
                               ref.embeddings.word_embeddings.weight[enc["input_ids"]])


def save_gpt2(folder: Path) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2,
                                     n_head=4, initializer_range=0.2, bos_token_id=96,
                                     eos_token_id=96, attn_implementation="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = transformers.GPT2LMHeadModel(config).eval()
        ref.save_pretrained(folder, safe_serialization=True)
    return ref


def test_gpt2_cache_equals_transformers(tmp_path: Path) -> None:
    ref = save_gpt2(tmp_path)
    model, _ = load_gpt2(tmp_path, tokenizer=False)
    ids = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        out, cache = run_with_cache(model, ids)
        want = ref(ids, output_hidden_states=True, output_attentions=True)
    # transformers' hidden_states: embeddings, each block's output, and the last one after
    # ln_f (it replaces the last block's output)
    torch.testing.assert_close(cache["blocks.0.hook_resid_pre"], want.hidden_states[0],
                               atol=ATOL, rtol=0)
    torch.testing.assert_close(cache["blocks.1.hook_resid_pre"], want.hidden_states[1],
                               atol=ATOL, rtol=0)
    torch.testing.assert_close(cache["ln_final.hook_normalized"], want.hidden_states[2],
                               atol=ATOL, rtol=0)
    for i in range(2):
        torch.testing.assert_close(cache[f"blocks.{i}.attn.hook_pattern"], want.attentions[i],
                                   atol=ATOL, rtol=0)
    torch.testing.assert_close(out.logits, want.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(cache["hook_pos_embed"],
                               ref.transformer.wpe.weight[:11].expand(2, 11, 32))


def test_float64_hand_computation_of_q_k_v_scores_pattern_z() -> None:
    E, H, D, L = 12, 3, 4, 5
    layer = hf.EncoderLayer(E, H, 20, dropout=0.0).double().eval()
    enc = hf.Encoder(layer, 2).double().eval()
    x = torch.randn(2, L, E, dtype=torch.float64)
    keep = torch.ones(2, 1, 1, L, dtype=torch.bool)
    keep[1, ..., 3:] = False
    _, cache = run_with_cache(enc, x, keep)
    mha = enc.blocks[1].attn
    h = cache["blocks.1.hook_resid_pre"]
    torch.testing.assert_close(h, cache["blocks.0.hook_resid_post"], atol=0, rtol=0)

    def heads(t: torch.Tensor) -> torch.Tensor:  # (B, L, E) -> (B, H, L, D), by hand
        return torch.stack([t[..., i * D:(i + 1) * D] for i in range(H)], dim=1)

    q = heads(h @ mha.q_proj.weight.T + mha.q_proj.bias)
    k = heads(h @ mha.k_proj.weight.T + mha.k_proj.bias)
    v = heads(h @ mha.v_proj.weight.T + mha.v_proj.bias)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(D)
    scores = scores.masked_fill(~keep, -math.inf)
    pattern = torch.exp(scores - scores.amax(-1, keepdim=True))
    pattern = pattern / pattern.sum(-1, keepdim=True)
    z = torch.einsum("bhqk,bhkd->bqhd", pattern, v)
    for name, want in (("q", q), ("k", k), ("v", v), ("attn_scores", scores),
                       ("pattern", pattern), ("z", z)):
        torch.testing.assert_close(cache[name, 1], want, atol=1e-12, rtol=0)
    torch.testing.assert_close(cache["attn_out", 1],
                               z.flatten(2) @ mha.out_proj.weight.T + mha.out_proj.bias,
                               atol=1e-12, rtol=0)


KINDS = {"full": hf.FullAttention, "local": lambda: hf.LocalAttention(3),
         "strided": lambda: hf.StridedAttention(2, global_tokens=1),
         "linear": hf.LinearAttention}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("causal", [False, True])
def test_every_kind_gives_its_pattern_and_the_same_output_on_the_explicit_path(
        kind: str, causal: bool) -> None:
    layer = hf.EncoderLayer(16, 2, 32, dropout=0.0, attention=KINDS[kind]())
    enc = hf.Encoder(layer, 2).eval()
    x = torch.randn(2, 9, 16)
    keep = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    keep[1, ..., 6:] = False
    with torch.no_grad():
        fast = enc(x, keep, causal=causal, need_weights=True)
        out, cache = run_with_cache(enc, x, keep, causal=causal)
    torch.testing.assert_close(out.last_hidden_state, fast.last_hidden_state, atol=ATOL, rtol=0)
    for i in range(2):
        torch.testing.assert_close(cache["pattern", i], fast.attentions[i], atol=ATOL, rtol=0)
    scores = cache["attn_scores", 0]
    allowed = enc.blocks[0].attn.attention.pattern(9, 9, causal=causal)
    if allowed is not None:
        blocked = scores[:, :, ~allowed]
        assert bool((blocked == (0 if kind == "linear" else -math.inf)).all())


def test_causal_lm_names_rotary_and_decoding_cache() -> None:
    config = hf.CausalLMConfig(vocab_size=50, max_len=32, d_model=16, num_heads=2,
                               num_layers=2, d_ff=32, positional="rotary")
    model = hf.CausalLM(config).eval()
    names = hook_names(model)
    assert "blocks.1.attn.hook_rot_q" in names and "hook_pos_embed" not in names
    assert "ln_final.hook_normalized" in names
    ids = torch.randint(0, 50, (1, 6))
    full, cache = run_with_cache(model, ids, names="blocks.*.attn.hook_pattern")
    step_cache = model.new_cache()
    model(ids[:, :5], cache=step_cache)
    seen = {}
    last = run_with_hooks(model, ids[:, 5:], cache=step_cache,
                          hooks={"blocks.1.attn.hook_pattern": lambda t, n: seen.update(p=t)})
    torch.testing.assert_close(seen["p"], cache["pattern", 1][:, :, 5:], atol=ATOL, rtol=0)
    torch.testing.assert_close(last.logits[:, -1], full.logits[:, -1], atol=ATOL, rtol=0)
    with pytest.raises(HookError, match="hook_pattern may not replace"):
        run_with_hooks(model, ids[:, :1], cache=model.new_cache(),
                       hooks={"blocks.0.attn.hook_pattern": lambda t, n: t.clone()})


def test_same_names_across_models() -> None:
    per_layer = {"hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_attn_out",
                 "hook_mlp_out", "attn.hook_q", "attn.hook_k", "attn.hook_v",
                 "attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z", "mlp.hook_pre",
                 "mlp.hook_post"}
    bert = hf.BertModel(hf.BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=2,
                                      num_attention_heads=2, intermediate_size=16))
    lm = hf.CausalLM(hf.CausalLMConfig(vocab_size=30, max_len=16, d_model=8, num_heads=2,
                                       num_layers=2, d_ff=16))
    enc = hf.Encoder(hf.EncoderLayer(8, 2, 16), 2)
    dec = hf.Decoder(hf.DecoderLayer(8, 2, 16), 2, final_norm=True)
    for model in (bert, lm, enc, dec):
        names = set(hook_names(model))
        for i in range(2):
            assert {f"blocks.{i}.{n}" for n in per_layer} <= names, type(model).__name__
    assert {"hook_embed", "hook_pos_embed"} <= set(hook_names(bert)) & set(hook_names(lm))
    assert "decoder.blocks.1.cross_attn.hook_pattern" in hook_names(hf.Transformer(
        16, 2, 1, 2, 32))
    assert "blocks.0.hook_resid_mid_cross" in hook_names(dec)
    assert not any("output" in n for n in hook_names(bert))  # BERT's 'output' modules: gone


def test_every_hook_name_is_its_module_path() -> None:
    """One name per part: ``cache[name]`` is what ``model.get_submodule(name)`` sees, in
    every model (no renaming rule between the two)."""
    models = [hf.BertModel(hf.BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=2,
                                         num_attention_heads=2, intermediate_size=16)),
              hf.CausalLM(hf.CausalLMConfig(vocab_size=30, max_len=16, d_model=8, num_heads=2,
                                            num_layers=2, d_ff=16, norm="rms", qk_norm=True,
                                            sandwich_norm=True, mlp="gated",
                                            positional="rotary")),
              hf.Transformer(8, 2, 1, 2, 16, norm_first=True)]
    for model in models:
        points = hf.inspect.hook_points(model)
        assert all(model.get_submodule(name) is point for name, point in points.items())
    lm = models[1]
    assert lm.blocks[1].attn.hook_pattern is hf.inspect.hook_points(lm)[
        "blocks.1.attn.hook_pattern"]
    assert {"blocks.0.ln1_post.hook_normalized", "blocks.0.attn.q_norm.hook_normalized",
            "ln_final.hook_normalized", "blocks.1.hook_mlp_in"} <= set(hook_names(lm))


@pytest.mark.parametrize("norm_first", [True, False])
def test_ln2_normalized_is_the_mlp_input_and_mlp_in_feeds_only_the_mlp(norm_first: bool) -> None:
    """``ln2.hook_normalized`` is what the MLP reads (pre-LN) and ``hook_mlp_in`` the
    residual entering the MLP branch: replacing it changes the MLP's output, not the
    residual it is added to (TransformerLens' ``use_hook_mlp_in``)."""
    config = hf.CausalLMConfig(vocab_size=30, max_len=16, d_model=8, num_heads=2,
                               num_layers=2, d_ff=16, norm_first=norm_first, dropout=0.0)
    model = hf.CausalLM(config).eval()
    ids = torch.randint(0, 30, (2, 5))
    seen = {}
    handle = model.blocks[1].mlp.register_forward_pre_hook(lambda m, a: seen.update(x=a[0]))
    with torch.no_grad():
        _, cache = run_with_cache(model, ids)
    handle.remove()
    assert torch.equal(cache["blocks.1.hook_mlp_in"], cache["blocks.1.hook_resid_mid"])
    if norm_first:
        assert torch.equal(seen["x"], cache["blocks.1.ln2.hook_normalized"])
    else:
        assert torch.equal(seen["x"], cache["blocks.1.hook_mlp_in"])
    zeros = {"blocks.1.hook_mlp_in": lambda t, n: torch.zeros_like(t)}
    with torch.no_grad(), hooks(model, zeros):
        _, patched = run_with_cache(model, ids)
    block = model.blocks[1]
    with torch.no_grad():
        mlp_of_zero = block.mlp(block.ln2(torch.zeros_like(seen["x"])) if norm_first
                                else torch.zeros_like(seen["x"]))
    torch.testing.assert_close(patched["blocks.1.hook_mlp_out"], mlp_of_zero, rtol=0, atol=0)
    torch.testing.assert_close(patched["blocks.1.hook_resid_mid"],
                               cache["blocks.1.hook_resid_mid"], rtol=0, atol=0)
    if norm_first:  # the residual goes on unchanged: resid_post = resid_mid + the new mlp_out
        torch.testing.assert_close(patched["blocks.1.hook_resid_post"],
                                   cache["blocks.1.hook_resid_mid"] + mlp_of_zero)


def test_patching_an_activation_with_itself_is_bit_identical() -> None:
    model, tok = load_bert()
    enc = tok(["The animal didn't cross the street because it was too tired", "It was."])
    with torch.no_grad():
        clean, cache = run_with_cache(model, enc)
        patched = run_with_hooks(model, enc, hooks={n: (lambda t, n: cache[n].clone())
                                                    for n in cache})
    assert torch.equal(patched.last_hidden_state, clean.last_hidden_state)
    assert torch.equal(patched.pooler_output, clean.pooler_output)


def test_hooks_last_one_call_and_one_thread() -> None:
    enc = hf.Encoder(hf.EncoderLayer(8, 2, 16, dropout=0.0), 1).eval()
    x = torch.randn(1, 4, 8)
    zero = {"blocks.0.hook_resid_post": lambda t, n: torch.zeros_like(t)}
    assert run_with_hooks(enc, x, hooks=zero).last_hidden_state.abs().sum() == 0
    assert enc(x).last_hidden_state.abs().sum() > 0  # nothing left behind
    with pytest.raises(RuntimeError, match="boom"), hooks(enc, zero):
        raise RuntimeError("boom")
    assert enc(x).last_hidden_state.abs().sum() > 0  # an exception does not leak it either
    inside, other = threading.Event(), {}

    def run_other() -> None:
        try:
            assert inside.wait(60)
            other["out"] = enc(x).last_hidden_state
        except BaseException as exc:  # noqa: BLE001 - re-raised below, not lost in the thread
            other["error"] = exc

    thread = threading.Thread(target=run_other)
    thread.start()
    with hooks(enc, zero):
        inside.set()
        thread.join(60)
        assert enc(x).last_hidden_state.abs().sum() == 0
    assert not thread.is_alive()
    if "error" in other:
        raise other["error"]
    assert other["out"].abs().sum() > 0  # the other thread never saw the hook


def test_bad_hook_names_and_replacements() -> None:
    enc = hf.Encoder(hf.EncoderLayer(8, 2, 16), 2)
    x = torch.randn(1, 4, 8)
    with pytest.raises(KeyError, match=r"'blocks\.0\.attn\.hook_patern'.*blocks\.0\.attn\."
                                       r"hook_pattern"):
        run_with_cache(enc, x, names="blocks.0.attn.hook_patern")
    with pytest.raises(KeyError, match="unknown hook name 'blocks.*.hook_nothing'"):
        run_with_hooks(enc, x, hooks={"blocks.*.hook_nothing": print})
    with pytest.raises(HookError, match=r"hook on 'blocks\.1\.attn\.hook_z' returned shape "
                                        r"\(1, 4, 8\).*\(1, 4, 2, 4\)"):
        run_with_hooks(enc, x, hooks={"blocks.1.attn.hook_z": lambda t, n: t.flatten(2)})
    with pytest.raises(HookError, match="torch.float64.*torch.float32"):
        run_with_hooks(enc, x, hooks={"blocks.0.hook_resid_pre": lambda t, n: t.double()})
    with pytest.raises(TypeError, match="must be callable"):
        run_with_hooks(enc, x, hooks={"blocks.0.hook_resid_pre": 3})
    _, cache = run_with_cache(enc, x, names=["blocks.*.hook_resid_post"])
    assert list(cache) == ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
    assert cache.stack("resid_post").shape == (2, 1, 4, 8)
    with pytest.raises(KeyError, match="was not kept"):
        cache["blocks.0.hook_resid_pre"]
