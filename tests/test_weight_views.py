"""TransformerLens' weight views (``model.W_E``, ``blocks[l].attn.W_Q``, ``model.cfg``...).

The reference is TransformerLens' own formulas written out here in float64 einsums on the
views (``q = x @ W_Q + b_Q`` per head, ``out = sum_h z_h @ W_O[h] + b_O``, the MLP's
``act(x @ W_in + b_in) @ W_out + b_out``), against the modules' forward; and the views are
checked against the weights as stored (``state_dict``, Hugging Face's layout), for memory
shared with the parameters, and for nothing registered twice.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import handformer as hf
from handformer.inspect import HookError, run_with_hooks

V, E, H, N = 37, 24, 4, 16


def model_of(dtype: torch.dtype = torch.float64, **options: object) -> hf.CausalLM:
    base = dict(vocab_size=V, max_len=N, d_model=E, num_heads=H, num_layers=2, d_ff=40,
                tie_weights=False)
    model = hf.CausalLM(hf.CausalLMConfig(**{**base, **options}))
    with torch.no_grad():
        for p in model.parameters():  # large random weights and biases: every term matters
            p.normal_(0, 0.4)
    return model.to(dtype).eval()  # (float64 unpacks q/k/v: model.to makes new tensors)


GPT2 = dict()
GQA = dict(num_kv_heads=2, qkv_bias=True, out_bias=False, norm="rms", mlp="gated",
           activation="silu", mlp_bias=False)
ROTARY = dict(positional="rotary", num_kv_heads=1, bias=False, head_dim=8)


def tl_attention(attn: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """TransformerLens' attention from the views: causal, no positions inside."""
    q = torch.einsum("ble,hed->blhd", x, attn.W_Q) + attn.b_Q  # (B, L, H, D)
    k = torch.einsum("ble,hed->blhd", x, attn.expanded_W_K()) + attn.expanded_b_K()
    v = torch.einsum("ble,hed->blhd", x, attn.expanded_W_V()) + attn.expanded_b_V()
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])  # (B, H, L, L)
    L = x.shape[1]
    scores = scores.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), -math.inf)
    z = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)  # (B, L, H, D)
    return torch.einsum("bqhd,hde->bqe", z, attn.W_O) + attn.b_O  # (B, L, E)


@pytest.mark.parametrize("options", [GPT2, GQA], ids=["gpt2", "gqa"])
def test_attention_from_the_views_is_the_module(options: dict) -> None:
    model = model_of(**options)
    x = torch.randn(2, 7, E, dtype=torch.float64)
    for block in model.blocks:
        want, _ = block.attn(x, causal=True)
        torch.testing.assert_close(tl_attention(block.attn, x), want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("options", [GPT2, GQA], ids=["plain", "gated"])
def test_mlp_from_the_views_is_the_module(options: dict) -> None:
    model = model_of(**options)
    x = torch.randn(2, 5, E, dtype=torch.float64)
    mlp = model.blocks[1].mlp
    if options.get("mlp") == "gated":
        got = (F.silu(x @ mlp.W_gate) * (x @ mlp.W_in + mlp.b_in)) @ mlp.W_out + mlp.b_out
    else:
        got = F.gelu(x @ mlp.W_in + mlp.b_in) @ mlp.W_out + mlp.b_out
    torch.testing.assert_close(got, mlp(x), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("options", [GPT2, GQA, ROTARY], ids=["gpt2", "gqa", "rotary"])
def test_views_are_the_stored_weights_in_tl_shapes(options: dict) -> None:
    model = model_of(**options)
    c, state = model.config, model.state_dict()
    H_kv, D = c.num_kv_heads or c.num_heads, c.head_dim
    attn = model.blocks[1].attn
    wq = state["blocks.1.attn.q_proj.weight"]  # (H * D, E), as Hugging Face stores it
    wk = state["blocks.1.attn.k_proj.weight"]
    wo = state["blocks.1.attn.out_proj.weight"]  # (E, H * D)
    assert attn.W_Q.shape == (H, E, D) and attn.W_K.shape == (H_kv, E, D)
    assert attn.W_O.shape == (H, D, E) and attn.expanded_W_K().shape == (H, E, D)
    for h in range(H):
        torch.testing.assert_close(attn.W_Q[h], wq[h * D:(h + 1) * D].T, atol=0, rtol=0)
        torch.testing.assert_close(attn.W_O[h], wo[:, h * D:(h + 1) * D].T, atol=0, rtol=0)
        g = h // (H // H_kv)  # the key head query head h reads
        torch.testing.assert_close(attn.expanded_W_K()[h], wk[g * D:(g + 1) * D].T, atol=0,
                                   rtol=0)
    assert model.W_E.shape == (V, E) and model.W_U.shape == (E, V)
    torch.testing.assert_close(model.W_E, state["tok_emb.weight"], atol=0, rtol=0)
    torch.testing.assert_close(model.W_U, state["lm_head.weight"].T, atol=0, rtol=0)
    assert not model.b_U.any() and model.b_U.shape == (V,)
    if "bias" in options:  # no biases: zeros, as TransformerLens' biases
        assert attn.b_Q.shape == (H, D) and not attn.b_Q.any() and not attn.b_O.any()
        assert not model.blocks[0].mlp.b_in.any()


def test_logits_from_w_u() -> None:
    model = model_of()
    ids = torch.randint(0, V, (1, 6))
    x = model.W_E[ids] + model.W_pos[:6]  # the residual stream before block 0
    for block in model.blocks:
        x = block(x, causal=True)
    logits = model.ln_final(x) @ model.W_U + model.b_U
    torch.testing.assert_close(logits, model(ids).logits, atol=1e-10, rtol=1e-10)


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("options", [GPT2, GQA], ids=["gpt2", "gqa"])
def test_views_share_memory_and_nothing_is_registered_twice(options: dict) -> None:
    model = model_of(torch.float32, **options)  # as built: q/k/v packed in one tensor
    names = [n for n, _ in model.named_parameters()]
    modules = [n for n, _ in model.named_modules()]
    keys = list(model.state_dict())
    attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
    assert model._modules["blocks"] is model.blocks  # the real ModuleList, no alias
    assert model.blocks[0]._modules["attn"] is attn and model.blocks[0]._modules["mlp"] is mlp
    # packed q/k/v: one tensor, and every view still reads it
    assert storage(attn.q_proj.weight) == storage(attn.k_proj.weight) == storage(attn.W_K)
    gated = hasattr(mlp, "up_proj")
    pairs = [(model.W_E, model.tok_emb.weight), (model.W_U, model.lm_head.weight),
             (model.W_pos, model.pos_emb.weight), (attn.W_Q, attn.q_proj.weight),
             (attn.W_K, attn.k_proj.weight), (attn.W_V, attn.v_proj.weight),
             (attn.W_O, attn.out_proj.weight),
             (mlp.W_in, mlp.up_proj.weight if gated else mlp.linear1.weight),
             (mlp.W_out, mlp.down_proj.weight if gated else mlp.linear2.weight)]
    for view, param in pairs:
        assert view.data_ptr() == param.data_ptr() and not isinstance(view, torch.nn.Parameter)
    if attn.q_proj.bias is not None:
        assert attn.b_K.data_ptr() == attn.k_proj.bias.data_ptr()
    with torch.no_grad():  # a write into a view is a write into the model
        attn.W_Q[1, 2, 3] = 123.0
    assert attn.q_proj.weight[1 * attn.head_dim + 3, 2] == 123.0
    # nothing new registered, even after reading every view
    assert [n for n, _ in model.named_parameters()] == names
    assert [n for n, _ in model.named_modules()] == modules and list(model.state_dict()) == keys
    assert not any(n.startswith("layers") or ".self_attn" in n for n in modules)  # no alias


def test_views_cannot_be_assigned() -> None:
    model = model_of()
    attn = model.blocks[0].attn
    cases = [(model, "W_E", torch.zeros(V, E)), (model, "W_U", torch.nn.Parameter(torch.zeros(1))),
             (model, "cfg", None),
             (attn, "W_Q", torch.nn.Parameter(torch.zeros(H, E, 6))), (attn, "b_O", None),
             (model.blocks[0].mlp, "W_in", torch.zeros(1))]
    for owner, name, value in cases:
        with pytest.raises(AttributeError, match=f"{name} is a read-only view of"):
            setattr(owner, name, value)
    with pytest.raises(AttributeError, match="read-only view of model.config"):
        model.cfg.n_heads = 2
    assert model.cfg.n_heads == H


def test_w_pos_is_refused_without_a_position_table() -> None:
    model = model_of(**ROTARY)
    with pytest.raises(AttributeError, match="no W_pos: its positions are 'rotary'"):
        _ = model.W_pos
    assert not hasattr(model, "W_pos")
    fixed = model_of(positional="sinusoidal")  # a fixed table added to the embeddings: a view
    assert fixed.W_pos.shape == (N, E) and fixed.W_pos.data_ptr() == fixed.pos_emb.pe.data_ptr()
    with pytest.raises(AttributeError, match="has no attribute 'W_gate'"):
        _ = model.blocks[0].mlp.W_gate  # a plain MLP has none, as in TransformerLens


@pytest.mark.parametrize("options", [GPT2, GQA, ROTARY], ids=["gpt2", "gqa", "rotary"])
def test_cfg_uses_transformer_lens_names(options: dict) -> None:
    model = model_of(**options)
    c, cfg = model.config, model.cfg
    assert (cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head, cfg.d_vocab, cfg.n_ctx,
            cfg.d_mlp) == (2, H, E, c.head_dim, V, N, 40)
    assert cfg.n_key_value_heads == (c.num_kv_heads or H)
    assert cfg.normalization_type == ("RMS" if c.norm == "rms" else "LN")
    assert cfg.act_fn == {"gelu": "gelu", "silu": "silu"}[c.activation]
    assert cfg.gated_mlp == (c.mlp == "gated")
    assert cfg.positional_embedding_type == {"learned": "standard", "rotary": "rotary"}[
        c.positional]
    with pytest.raises(AttributeError, match="model.cfg has no 'n_experts'"):
        _ = cfg.n_experts


def test_a_q_hook_of_tl_layout_is_told_the_difference() -> None:
    model = model_of()

    def tl_layout(q: torch.Tensor, name: str) -> torch.Tensor:
        return q.transpose(1, 2).contiguous()  # (B, L, H, D), what a TransformerLens hook keeps

    with pytest.raises(HookError, match=r"hook_q is \(B, heads, L, D\) here, where "
                                        r"TransformerLens' is \(B, L, heads, D\)"):
        run_with_hooks(model, torch.randint(0, V, (1, 5)),
                       hooks={"blocks.0.attn.hook_q": tl_layout})


def test_views_of_a_transformers_llama_are_its_weights(tmp_path) -> None:  # noqa: ANN001
    """A GQA Llama written by transformers, loaded (packed q/k/v): the views are transformers'
    own tensors, in TransformerLens' shapes."""
    transformers = pytest.importorskip("transformers")
    import warnings

    from handformer.pretrained import load_lm

    config = transformers.LlamaConfig(vocab_size=V, hidden_size=E, intermediate_size=40,
                                      num_hidden_layers=2, num_attention_heads=H,
                                      num_key_value_heads=2, max_position_embeddings=N,
                                      attention_bias=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = transformers.LlamaForCausalLM(config).eval()
        with torch.no_grad():
            for p in ref.parameters():
                p.normal_(0, 0.3)
        ref.save_pretrained(tmp_path, safe_serialization=True)
    model, _ = load_lm(tmp_path, tokenizer=False)
    D = E // H
    for i, block in enumerate(model.blocks):
        hf_attn, hf_mlp = ref.model.layers[i].self_attn, ref.model.layers[i].mlp
        assert block.attn.q_proj.weight.data_ptr() + H * D * E * 4 == \
            block.attn.W_K.data_ptr()  # packed: k's rows follow q's, and W_K still views them
        for h in range(H):
            rows = slice(h * D, (h + 1) * D)  # head h's rows of Hugging Face's (H * D, E)
            torch.testing.assert_close(block.attn.W_Q[h], hf_attn.q_proj.weight[rows].T)
            torch.testing.assert_close(block.attn.b_Q[h], hf_attn.q_proj.bias[rows])
            torch.testing.assert_close(block.attn.W_O[h], hf_attn.o_proj.weight[:, rows].T)
        for g in range(2):
            rows = slice(g * D, (g + 1) * D)
            torch.testing.assert_close(block.attn.W_V[g], hf_attn.v_proj.weight[rows].T)
        torch.testing.assert_close(block.mlp.W_gate, hf_mlp.gate_proj.weight.T)
        torch.testing.assert_close(block.mlp.W_in, hf_mlp.up_proj.weight.T)
        torch.testing.assert_close(block.mlp.W_out, hf_mlp.down_proj.weight.T)
    torch.testing.assert_close(model.W_E, ref.model.embed_tokens.weight)
    torch.testing.assert_close(model.W_U, ref.lm_head.weight.T)
    assert model.cfg.n_key_value_heads == 2 and model.cfg.d_head == D
