"""The Llama-family layers (issue 20, model side) against independent references.

References: float64 formulas written out here (RMSNorm, a grouped-query attention that
repeats K/V explicitly, soft-capping, the RoPE scaling rules), transformers' own RoPE
frequency functions (test-only), the model recomputing the whole sequence (for caches, the
plain step, left padding). Each subtle detail has a mutation check: switching it off makes
the comparison fail.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import handformer as hf
from handformer import inspect
from handformer.attention.cache import KVCache, StaticKVCache, WindowKVCache
from handformer.models.plain_step import PlainDecodeStep, plain_step_refusal
from handformer.norms import LayerNorm, RMSNorm, make_norm
from handformer.positional_rotary import RotaryEmbedding, rope_inv_freq

V = 41

LLAMA = dict(vocab_size=V, max_len=64, d_model=24, num_heads=4, num_kv_heads=2, num_layers=3,
             d_ff=40, positional="rotary", bias=False, norm="rms", mlp="gated",
             activation="silu", layer_norm_eps=1e-6, tie_weights=False,
             rotary_freq_dtype="float32")
# Gemma-shaped: every feature at once (head_dim independent of d_model, qk-norm, sandwich
# norms, 1 + w norms, embedding scale, attention scale, both soft-caps, sliding layers with
# their own RoPE base, linear RoPE scaling on the global layers).
GEMMA = dict(LLAMA, num_layers=4, head_dim=10, num_kv_heads=1, norm_offset=1.0,
             activation="gelu_tanh", qk_norm=True, sandwich_norm=True,
             embed_scale=24 ** 0.5, attn_scale=0.25, attn_softcap=3.0, final_softcap=4.0,
             layer_types=["local", "full", "local", "local"], window_size=7,
             rotary_local_base=100.0, rotary_scaling={"rope_type": "linear", "factor": 2.0})
QWEN = dict(LLAMA, qkv_bias=True, out_bias=False, qk_norm=True)


def make(dtype: torch.dtype = torch.float32, **config: object) -> hf.CausalLM:
    torch.manual_seed(0)
    model = hf.CausalLM(hf.CausalLMConfig(**config)).eval()
    with torch.no_grad():  # weights far from their defaults: norms, biases, large logits
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.5 if p.dim() > 1 else 0.3))
    return model.to(dtype)


# ---- norms ------------------------------------------------------------------------------------


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rmsnorm_is_the_float64_formula(offset: float) -> None:
    norm = RMSNorm(12, eps=1e-5, offset=offset).double()
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 12, dtype=torch.float64) * 3
    ref = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * (offset + norm.weight)
    torch.testing.assert_close(norm(x), ref, rtol=1e-14, atol=1e-14)
    if offset:  # mutation: the same weights without the offset give another output
        without = RMSNorm(12, eps=1e-5).double()
        without.load_state_dict(norm.state_dict())
        assert (without(x) - ref).abs().max() > 0.1


def test_rmsnorm_computes_half_inputs_in_float32_and_hooks_its_scale() -> None:
    norm = RMSNorm(64, offset=1.0)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(2, 3, 64) * 50
    xb, wb = x.bfloat16().float(), norm.weight.detach().bfloat16().float()
    ref_b = (xb / torch.sqrt(xb.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + wb)).bfloat16()
    out = norm.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref_b)  # float32 inside: exactly the rounded float32 result
    norm.float()
    seen = {}
    with _listen(norm.hook_scale, seen):
        out = norm(x)
    torch.testing.assert_close(seen["scale"], torch.sqrt(x.pow(2).mean(-1, keepdim=True)
                                                         + 1e-6))
    torch.testing.assert_close(out, x / seen["scale"] * (1 + wb))  # weights now bf16-rounded
    assert seen["scale"].shape == (2, 3, 1)


def _listen(point, seen: dict, replace=None):  # noqa: ANN001, ANN202
    from handformer.hooks import active_hooks

    def fn(t, name):  # noqa: ANN001, ANN202
        seen[name] = t
        return replace(t) if replace is not None else None

    return active_hooks({point: (("scale", fn),)})


def test_layernorm_keeps_torch_keys_and_its_explicit_path_matches() -> None:
    norm = LayerNorm(10, eps=1e-5)
    assert isinstance(norm, torch.nn.LayerNorm)
    assert set(norm.state_dict()) == {"weight", "bias"}
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(4, 10) * 3 + 1
    seen = {}
    with _listen(norm.hook_scale, seen):
        explicit = norm(x)
    torch.testing.assert_close(explicit, norm(x))
    torch.testing.assert_close(seen["scale"], torch.sqrt(x.var(-1, unbiased=False,
                                                               keepdim=True) + 1e-5))
    # a replaced scale is the one applied
    with _listen(norm.hook_scale, {}, replace=lambda t: t * 2):
        halved = norm(x)
    torch.testing.assert_close(halved - norm.bias, (norm(x) - norm.bias) / 2)
    with pytest.raises(ValueError, match="offset=1.0 applies to RMSNorm only"):
        make_norm("layer", 4, eps=1e-5, offset=1.0)
    with pytest.raises(ValueError, match="norm must be one of"):
        make_norm("batch", 4, eps=1e-5)


# ---- attention: GQA, soft-capping, hooks ------------------------------------------------------


def reference_attention(mha: hf.MultiHeadAttention, x: torch.Tensor, *, keep: torch.Tensor,
                        softcap: float | None = None, window: int | None = None
                        ) -> torch.Tensor:
    """float64 causal attention with K/V repeated explicitly for each query head."""
    B, L, _ = x.shape
    H, H_kv, D = mha.num_heads, mha.num_kv_heads, mha.head_dim

    def proj(lin: torch.nn.Linear, heads: int) -> torch.Tensor:
        out = x @ lin.weight.T + (0 if lin.bias is None else lin.bias)
        return out.view(B, L, heads, D).transpose(1, 2)

    q, k, v = proj(mha.q_proj, H), proj(mha.k_proj, H_kv), proj(mha.v_proj, H_kv)
    k = torch.stack([k[:, h // (H // H_kv)] for h in range(H)], 1)  # repeat each kv head
    v = torch.stack([v[:, h // (H // H_kv)] for h in range(H)], 1)
    scale = mha.scale if mha.scale is not None else D ** -0.5
    s = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(L)
    allowed = (i[None, :] <= i[:, None]) & keep[:, None, None, :]
    if window is not None:
        allowed = allowed & (i[:, None] - i[None, :] <= window // 2)
    s = s.masked_fill(~allowed, float("-inf"))
    z = torch.softmax(s, -1).nan_to_num(0.0) @ v  # (B, H, L, D)
    out = z.transpose(1, 2).reshape(B, L, H * D) @ mha.out_proj.weight.T
    return out + (0 if mha.out_proj.bias is None else mha.out_proj.bias)


@pytest.mark.parametrize("kv_heads", [2, 1])  # grouped-query, multi-query
@pytest.mark.parametrize("need_weights", [False, True])
def test_gqa_matches_a_reference_that_repeats_kv(kv_heads: int, need_weights: bool) -> None:
    torch.manual_seed(1)
    mha = hf.MultiHeadAttention(12, 4, num_kv_heads=kv_heads, head_dim=5, qkv_bias=True,
                                out_bias=False, scale=0.3).double()
    assert mha.k_proj.weight.shape == (kv_heads * 5, 12) and mha.out_proj.bias is None
    assert mha.q_proj.bias is not None
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    keep = torch.tensor([[True] * 7, [False] * 2 + [True] * 5])
    out, w = mha(x, mask=keep[:, None, None, :], causal=True, need_weights=need_weights)
    ref = reference_attention(mha, x, keep=keep)
    torch.testing.assert_close(out[1, 2:], ref[1, 2:], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-12, atol=1e-12)
    if need_weights:
        assert w.shape == (2, 4, 7, 7)


def test_softcap_is_the_formula_before_the_mask() -> None:
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 3, 6, 8, dtype=torch.float64) * 4 for _ in range(3))
    out, w = hf.scaled_dot_product_attention(q, k, v, causal=True, softcap=2.0,
                                             need_weights=True)
    s = 2.0 * torch.tanh(q @ k.transpose(-1, -2) / math.sqrt(8) / 2.0)
    s = s.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(w, torch.softmax(s, -1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v, rtol=1e-12, atol=1e-12)
    plain, _ = hf.scaled_dot_product_attention(q, k, v, causal=True)
    assert (plain - out).abs().max() > 1e-2  # mutation: the cap matters here
    # the kinds: full, and local (tile path) against the dense masked formula
    full, _ = hf.FullAttention(softcap=2.0)(q, k, v, causal=True)
    torch.testing.assert_close(full, out, rtol=1e-12, atol=1e-12)
    local, lw = hf.LocalAttention(5, causal=True, softcap=2.0)(q, k, v, need_weights=True)
    i = torch.arange(6)
    band = (i[None] <= i[:, None]) & (i[:, None] - i[None] <= 2)
    s2 = (2.0 * torch.tanh(q @ k.transpose(-1, -2) / math.sqrt(8) / 2.0)).masked_fill(
        ~band, float("-inf"))
    torch.testing.assert_close(local, torch.softmax(s2, -1) @ v, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lw, torch.softmax(s2, -1), rtol=1e-12, atol=1e-12)
    local_no_w, _ = hf.LocalAttention(5, causal=True, softcap=2.0)(q, k, v)
    torch.testing.assert_close(local_no_w, local, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="softcap must be None or a positive finite number"):
        hf.FullAttention(softcap=0)


def test_mha_softcap_window_and_qk_norm_against_the_reference() -> None:
    torch.manual_seed(3)
    mha = hf.MultiHeadAttention(12, 4, num_kv_heads=2, head_dim=6, bias=False,
                                attention=hf.LocalAttention(5, causal=True, softcap=1.5),
                                qk_norm=True, norm_offset=1.0).double()
    x = torch.randn(1, 9, 12, dtype=torch.float64)
    with torch.no_grad():
        mha.q_norm.weight.normal_()
        mha.k_norm.weight.normal_()
    out, _ = mha(x, causal=True)

    def normed(norm: RMSNorm):  # noqa: ANN202
        def f(t):  # noqa: ANN001, ANN202
            return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + norm.weight)
        return f

    # reference with qk-norm applied per head by hand
    B, L = 1, 9
    q = (x @ mha.q_proj.weight.T).view(B, L, 4, 6).transpose(1, 2)
    k = (x @ mha.k_proj.weight.T).view(B, L, 2, 6).transpose(1, 2)
    v = (x @ mha.v_proj.weight.T).view(B, L, 2, 6).transpose(1, 2)
    q, k = normed(mha.q_norm)(q), normed(mha.k_norm)(k)
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = 1.5 * torch.tanh(q @ k.transpose(-1, -2) / math.sqrt(6) / 1.5)
    i = torch.arange(L)
    s = s.masked_fill(~((i[None] <= i[:, None]) & (i[:, None] - i[None] <= 2)), float("-inf"))
    ref = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, L, 24) @ mha.out_proj.weight.T
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_hook_shapes_and_hook_result_sums_to_the_attention_output() -> None:
    torch.manual_seed(4)
    mha = hf.MultiHeadAttention(12, 4, num_kv_heads=2, head_dim=6, qkv_bias=True,
                                out_bias=True, rotary=RotaryEmbedding(6))
    x = torch.randn(2, 6, 12)
    names = {"hook_q": mha.hook_q, "hook_k": mha.hook_k, "hook_v": mha.hook_v,
             "hook_z": mha.hook_z, "hook_result": mha.hook_result,
             "hook_pattern": mha.hook_pattern}
    seen = {}
    from handformer.hooks import active_hooks

    def keep(t, name):  # noqa: ANN001, ANN202
        seen[name] = t

    with active_hooks({p: ((n, keep),) for n, p in names.items()}):
        out, _ = mha(x, causal=True)
    assert seen["hook_q"].shape == (2, 4, 6, 6)
    assert seen["hook_k"].shape == seen["hook_v"].shape == (2, 2, 6, 6)  # H_kv heads
    assert seen["hook_pattern"].shape == (2, 4, 6, 6)
    assert seen["hook_z"].shape == (2, 6, 4, 6)
    assert seen["hook_result"].shape == (2, 6, 4, 12)
    torch.testing.assert_close(seen["hook_result"].sum(2) + mha.out_proj.bias, out)
    torch.testing.assert_close(out, mha(x, causal=True)[0], rtol=1e-5, atol=1e-6)
    # a replaced per-head result is what the layer adds up: zeroing head 1 = ablating its z
    with active_hooks({mha.hook_result: (("r", lambda t, n: t.index_fill(2, torch.tensor([1]),
                                                                          0.0)),)}):
        ablated, _ = mha(x, causal=True)
    with active_hooks({mha.hook_z: (("z", lambda t, n: t.index_fill(2, torch.tensor([1]),
                                                                     0.0)),)}):
        via_z, _ = mha(x, causal=True)
    torch.testing.assert_close(ablated, via_z, rtol=1e-5, atol=1e-6)
    assert (ablated - out).abs().max() > 1e-3


def test_model_hook_names_for_the_new_parts() -> None:
    model = make(**GEMMA)
    names = inspect.hook_names(model)
    for name in ("blocks.0.ln1.hook_scale", "blocks.0.ln2.hook_scale",
                 "blocks.0.ln1_post.hook_scale", "blocks.0.ln2_post.hook_scale",
                 "ln_final.hook_scale", "blocks.1.attn.hook_result",
                 "blocks.1.mlp.hook_pre_linear", "blocks.0.attn.q_norm.hook_scale"):
        assert name in names, name
    ids = torch.randint(0, V, (1, 9))
    logits, cache = inspect.run_with_cache(model, ids, names=["blocks.*.attn.hook_k",
                                                               "blocks.*.attn.hook_result",
                                                               "ln_final.hook_scale",
                                                               "blocks.*.hook_attn_out"])
    assert cache["blocks.0.attn.hook_k"].shape == (1, 1, 9, 10)
    assert cache["ln_final.hook_scale"].shape == (1, 9, 1)
    # with a sandwich norm the per-head results add up to the attention output before it
    torch.testing.assert_close(
        model.blocks[1].ln1_post(cache["blocks.1.attn.hook_result"].sum(2)),
        cache["blocks.1.hook_attn_out"], rtol=1e-4, atol=1e-5)


# ---- RoPE scaling -----------------------------------------------------------------------------


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _llama3_formula(dim: int, base: float, s: dict) -> list[float]:
    """Meta's Llama 3.1 rule, element by element in Python floats (float64)."""
    out = []
    for i in range(0, dim, 2):
        theta = base ** (-i / dim)
        wavelen = 2 * math.pi / theta
        low_wl = s["original_max_position_embeddings"] / s["low_freq_factor"]
        high_wl = s["original_max_position_embeddings"] / s["high_freq_factor"]
        if wavelen < high_wl:
            out.append(theta)
        elif wavelen > low_wl:
            out.append(theta / s["factor"])
        else:
            t = ((s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"])
                 / (s["high_freq_factor"] - s["low_freq_factor"]))
            out.append((1 - t) * theta / s["factor"] + t * theta)
    return out


def test_rope_scaling_matches_the_formulas_in_float64() -> None:
    dim, base = 64, 500000.0
    ours = rope_inv_freq(dim, base, scaling=LLAMA3, dtype=torch.float64)
    ref = torch.tensor(_llama3_formula(dim, base, LLAMA3), dtype=torch.float64)
    torch.testing.assert_close(ours, ref, rtol=1e-13, atol=0)
    # the three bands are all present at these numbers (so each branch is tested)
    wavelen = 2 * math.pi / ref
    assert (wavelen < 16).any() and (wavelen > 64).any()
    assert ((wavelen >= 16) & (wavelen <= 64)).any()
    linear = rope_inv_freq(dim, base, scaling={"rope_type": "linear", "factor": 4.0})
    torch.testing.assert_close(linear, torch.tensor([base ** (-i / dim) / 4
                                                     for i in range(0, dim, 2)],
                                                    dtype=torch.float64), rtol=1e-13, atol=0)
    # mutation: an unscaled table differs
    assert not torch.allclose(rope_inv_freq(dim, base), ref)
    # the rotation uses them: angle of pair i at position p is p * theta_i
    rot = RotaryEmbedding(dim, base=base, scaling=LLAMA3)
    cos, sin = rot.cos_sin(torch.tensor([[37]]), torch.float64, torch.device("cpu"))
    torch.testing.assert_close(cos.flatten(), torch.cos(37 * ref), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3])
def test_float32_frequencies_are_transformers_bit_for_bit(scaling: dict | None) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "default", "rope_theta": 500000.0, **(scaling or {})}
    config = transformers.LlamaConfig(hidden_size=128, num_attention_heads=2,
                                      rope_parameters=params)
    if scaling is None:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        ref = LlamaRotaryEmbedding(config).inv_freq
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    ours = rope_inv_freq(64, 500000.0, scaling=scaling, dtype=torch.float32)
    assert torch.equal(ours, ref)


# ---- the model: caches, padding, the plain step, generate -------------------------------------


@pytest.mark.parametrize("config", [LLAMA, QWEN, GEMMA], ids=["llama", "qwen", "gemma"])
def test_cached_decoding_equals_recomputing(config: dict) -> None:
    model = make(**config)
    ids = torch.randint(0, V, (2, 20))
    with torch.inference_mode():
        full = model(ids).logits
        cache = model.new_cache()
        parts = [model(ids[:, :6], cache=cache).logits]
        parts += [model(ids[:, i:i + 1], cache=cache).logits for i in range(6, 17)]
        parts.append(model(ids[:, 17:], cache=cache).logits)  # several tokens at once
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-4, atol=1e-4)


def test_a_left_padded_row_equals_the_row_alone() -> None:
    model = make(**GEMMA)
    ids = torch.randint(0, V, (2, 14))
    mask = torch.tensor([[1] * 14, [0] * 5 + [1] * 9])
    with torch.inference_mode():
        batch = model(ids, attention_mask=mask).logits
        alone = model(ids[1:, 5:]).logits
        torch.testing.assert_close(batch[1, 5:], alone[0], rtol=1e-4, atol=1e-4)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=8)
        single = model.generate(ids[1:, 5:], max_new_tokens=8)
    assert torch.equal(out[1, 14:], single[0, 9:])


@pytest.mark.parametrize("config", [LLAMA, QWEN, GEMMA], ids=["llama", "qwen", "gemma"])
def test_plain_step_equals_the_module_step(config: dict) -> None:
    model = make(**config)
    ids = torch.randint(0, V, (2, 18))
    mask = torch.tensor([[1] * 18, [0] * 3 + [1] * 15])
    with torch.inference_mode():
        full = model(ids, attention_mask=mask).logits
        caches = []
        for _ in range(2):
            cache = model.new_cache(capacity=18)
            model(ids[:, :8], attention_mask=mask[:, :8], cache=cache)
            caches.append(cache)
        assert plain_step_refusal(model, caches[0]) is None
        step = PlainDecodeStep.build(model, caches[0])
        plain = torch.stack([step(ids[:, i]) for i in range(8, 18)], 1)
        modules = torch.stack([model.decode_step(ids[:, i:i + 1], caches[1])
                               for i in range(8, 18)], 1)
    torch.testing.assert_close(plain, modules, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(plain, full[:, 8:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("config", [LLAMA, GEMMA], ids=["llama", "gemma"])
def test_generate_greedy_and_sampling_agree_on_every_path(config: dict) -> None:
    model = make(**config)
    ids = torch.randint(0, V, (2, 9))
    plain = model.generate(ids, max_new_tokens=12)
    assert torch.equal(plain, model.generate(ids, max_new_tokens=12, plain_step=False))
    assert torch.equal(plain, model.generate(ids, max_new_tokens=12, use_cache=False))
    runs = [model.generate(ids, max_new_tokens=12, do_sample=True, top_k=10,
                           generator=torch.Generator().manual_seed(5), plain_step=p)
            for p in (True, False)]
    assert torch.equal(*runs)
    eos = int(plain[0, 11])  # the third new token of row 0
    stopped = model.generate(ids[:1], max_new_tokens=12, eos_token_id=eos)
    first = int((plain[0, 9:] == eos).nonzero()[0])
    assert stopped.shape[1] == 10 + first and int(stopped[0, -1]) == eos


def test_compiled_generate_on_a_gemma_shaped_model() -> None:
    model = make(**{**GEMMA, "num_layers": 2, "layer_types": ["local", "full"]})
    ids = torch.randint(0, V, (2, 10))
    mask = torch.tensor([[1] * 10, [0] * 2 + [1] * 8])
    eager = model.generate(ids, attention_mask=mask, max_new_tokens=10)
    cache = model.new_cache(capacity=32, static=True)
    assert [type(c) for c in cache.layers] == [StaticKVCache, StaticKVCache]
    assert cache.layers[0].window_size == 7 and cache.layers[1].window_size is None
    compiled = model.generate(ids, attention_mask=mask, max_new_tokens=10, compile=True,
                              compile_backend="aot_eager")
    assert torch.equal(eager, compiled)


def _kv_bytes(cache) -> int:  # noqa: ANN001
    return sum(t.numel() * t.element_size() for c in cache.layers for t in (c._k, c._v))


def test_kv_cache_memory_is_kv_heads_over_heads() -> None:
    ids = torch.randint(0, V, (1, 30))
    sizes = {}
    for kv in (4, 2, 1):
        model = make(**{**LLAMA, "num_kv_heads": kv})
        cache = model.new_cache(capacity=30)
        with torch.inference_mode():
            model(ids, cache=cache)
        assert all(c._k.shape[1] == kv for c in cache.layers)
        sizes[kv] = _kv_bytes(cache)
    assert sizes[2] * 2 == sizes[4] and sizes[1] * 4 == sizes[4]


def test_a_sliding_layer_cache_stays_at_its_window() -> None:
    model = make(**GEMMA)  # window_size 7 = a Hugging Face sliding_window of 4
    cache = model.new_cache(capacity=60)
    ids = torch.randint(0, V, (1, 50))
    with torch.inference_mode():
        model(ids[:, :20], cache=cache)
        step = PlainDecodeStep.build(model, cache)
        for i in range(20, 50):
            step(ids[:, i])
    local = [c for c in cache.layers if isinstance(c, WindowKVCache)]
    full = [c for c in cache.layers if isinstance(c, KVCache)]
    assert len(local) == 3 and len(full) == 1
    assert all(c.num_keys == 3 for c in local)  # W - 1 = 3 keys
    assert full[0].num_keys == 50
    # the plain step's ring: the 3 keys of the window and the slot of the next one, k and v,
    # (1, 1, 4, 10) float32 each, whatever the length
    assert all(c.nbytes() == 2 * 4 * 10 * 4 for c in local)


def test_each_feature_changes_the_output() -> None:
    """Mutation checks: turning off one detail changes the logits, so the comparisons above
    would catch an implementation that dropped it."""
    ids = torch.randint(0, V, (1, 16))
    reference = make(**GEMMA)(ids).logits
    for change in ({"qk_norm": False}, {"norm_offset": 0.0}, {"attn_softcap": None},
                   {"final_softcap": None}, {"window_size": 15}, {"embed_scale": None},
                   {"attn_scale": None}, {"rotary_local_base": None},
                   {"sandwich_norm": False}):
        model = make(**{**GEMMA, **change})
        # Same weights where the parameter sets agree (a shape mismatch would raise: then the
        # difference below would come from other weights, not from the change).
        model.load_state_dict(make(**GEMMA).state_dict(), strict=False)
        assert (model(ids).logits - reference).abs().max() > 1e-3, change


def test_embed_scale_is_rounded_to_the_model_dtype() -> None:
    model = make(torch.bfloat16, **GEMMA)
    ids = torch.randint(0, V, (1, 5))
    seen = {}
    from handformer.hooks import active_hooks

    with active_hooks({model.hook_embed: (("e", lambda t, n: seen.setdefault("e", t)),)}):
        model(ids)
    expected = model.tok_emb(ids) * torch.tensor(24 ** 0.5, dtype=torch.bfloat16)
    assert torch.equal(seen["e"], expected)
    assert float(torch.tensor(24 ** 0.5, dtype=torch.bfloat16)) != 24 ** 0.5


def test_per_layer_rotary_tables() -> None:
    model = make(**GEMMA)
    local, full = model.blocks[0].attn.rotary, model.blocks[1].attn.rotary
    assert local is model.blocks[2].attn.rotary and local is not full
    assert local.base == 100.0 and local.scaling is None
    assert full.base == 10000.0 and full.scaling == {"rope_type": "linear", "factor": 2.0}
    assert isinstance(model.blocks[0].attn.attention, hf.LocalAttention)
    assert model.blocks[0].attn.attention.causal
    assert type(model.blocks[1].attn.attention) is hf.FullAttention


def test_gated_mlp_is_the_formula() -> None:
    ff = hf.GatedFeedForward(6, 10, activation="silu").double()
    x = torch.randn(2, 3, 6, dtype=torch.float64)
    ref = (F.silu(x @ ff.gate_proj.weight.T) * (x @ ff.up_proj.weight.T)) @ ff.down_proj.weight.T
    torch.testing.assert_close(ff(x), ref, rtol=1e-13, atol=1e-13)


# ---- config: round trip, old configs, refusals ------------------------------------------------


def test_save_and_load_round_trip_the_new_fields(tmp_path) -> None:  # noqa: ANN001
    model = make(**GEMMA)
    loaded = hf.CausalLM.from_pretrained(model.save_pretrained(tmp_path))
    assert loaded.config == model.config
    ids = torch.randint(0, V, (1, 12))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_a_gpt2_config_dict_is_unchanged() -> None:
    config = hf.CausalLMConfig(vocab_size=10, max_len=8, d_model=8, num_heads=2,
                               num_layers=1, d_ff=8)
    assert config.head_dim == 4
    assert set(config.to_dict()) == {
        "vocab_size", "max_len", "d_model", "num_heads", "num_layers", "d_ff", "dropout",
        "activation", "positional", "attention", "window_size", "stride", "tie_weights",
        "norm_first", "layer_norm_eps", "bias", "rotary_base"}
    assert hf.CausalLMConfig.from_dict(config.to_dict()) == config


def test_qwen2_sized_windows_are_accepted() -> None:
    config = hf.CausalLMConfig(**{**LLAMA, "num_layers": 1, "layer_types": ["local"],
                                  "window_size": 2 * 131072 - 1})
    model = hf.CausalLM(config)
    assert model.blocks[0].attn.attention.window_size == 262143
    model(torch.randint(0, V, (1, 5)))


@pytest.mark.parametrize(("change", "message"), [
    ({"num_kv_heads": 3}, "num_kv_heads=3 must divide num_heads=4"),
    ({"layer_types": ["full", "local"]}, "layer_types must be a list of num_layers=3 entries"),
    ({"layer_types": ["full", "sliding", "full"], "window_size": 5},
     "layer_types entries must be one of ['full', 'local'], got 'sliding'"),
    ({"rotary_scaling": {"rope_type": "yarn", "factor": 2.0}},
     "rotary_scaling rope_type must be one of ['linear', 'llama3'], got 'yarn'"),
    ({"activation": "swiglu"}, "activation must be one of"),
    ({"norm": "batch"}, "norm must be one of ['layer', 'rms'], got 'batch'"),
    ({"mlp": "moe"}, "mlp must be one of ['plain', 'gated'], got 'moe'"),
    ({"layer_types": ["local"] * 3}, "window_size must be a positive integer, got None"),
    ({"attn_softcap": -1.0}, "attn_softcap must be None or a positive finite number, got -1.0"),
    ({"norm": "layer", "norm_offset": 1.0}, "norm_offset=1.0 applies to norm='rms' only"),
    ({"sandwich_norm": True, "norm_first": False}, "sandwich_norm=True needs norm_first=True"),
])
def test_config_refusals_name_the_field(change: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        hf.CausalLMConfig(**{**LLAMA, **change})
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_one_rotary_table_per_forward_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make(**GEMMA)  # two tables: local layers' and global layers'
    calls = []
    original = RotaryEmbedding.cos_sin

    def counting(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(self.base)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(RotaryEmbedding, "cos_sin", counting)
    ids = torch.randint(0, V, (1, 8))
    first = model(ids).logits
    assert sorted(calls) == [100.0, 10000.0]
    calls.clear()
    torch.testing.assert_close(model(ids[:, :5]).logits, first[:, :5], rtol=1e-5, atol=1e-5)
    assert len(calls) == 2  # recomputed for the new positions, not reused from the last pass
