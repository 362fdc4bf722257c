"""The plain-function decoding step (models/plain_step.py) against the modules and a recompute.

References: the whole sequence recomputed by ``model(ids)`` (no cache at all), and the
modules' cached step ``model.decode_step``; each configuration the plain step covers
(pre/post-LN, learned/sinusoidal/rotary positions, biases or none, every activation, tied or
separate head, left padding, float64) and the cases it must hand back to the modules.
"""

from __future__ import annotations

import copy

import pytest
import torch

import handformer as hf
from handformer import inspect
from handformer.attention.cache import KVCache
from handformer.models.plain_step import PlainDecodeStep, _Norm, plain_step_refusal
from handformer.packing import packed_linear

V = 31

CONFIGS = [
    dict(),
    dict(norm_first=False),
    dict(positional="sinusoidal", activation="relu"),
    dict(positional="rotary", activation="gelu"),
    dict(positional="rotary", norm_first=False, bias=False),
    dict(bias=False, tie_weights=False, activation="gelu_tanh"),
    dict(attention="local", window_size=5),  # the rolling window cache
    # Llama / Qwen3 / Gemma features: RMSNorm (with Gemma's offset), gated MLP, GQA, QK-norm,
    # q/k/v biases without an output bias, sandwich norms
    dict(positional="rotary", norm="rms", mlp="gated", activation="silu", num_kv_heads=1,
         qkv_bias=True, out_bias=False, mlp_bias=False, qk_norm=True),
    dict(positional="rotary", norm="rms", norm_offset=1.0, mlp="gated", activation="gelu_tanh",
         num_kv_heads=1, bias=False, sandwich_norm=True, head_dim=12, qk_norm=True),
]


def make(dtype: torch.dtype = torch.float32, **overrides: object) -> hf.CausalLM:
    base = dict(vocab_size=V, max_len=40, d_model=16, num_heads=2, num_layers=3, d_ff=24)
    torch.manual_seed(0)
    model = hf.CausalLM(hf.CausalLMConfig(**{**base, **overrides})).eval()
    with torch.no_grad():  # larger weights: well separated logits, varied greedy outputs
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(10)
            else:  # non-trivial LayerNorm gains and biases
                p.add_(torch.randn_like(p) * 0.3)
    return model.to(dtype)


def prefilled(model: hf.CausalLM, ids: torch.Tensor, mask: torch.Tensor | None, n: int):
    cache = model.new_cache(capacity=ids.shape[1])
    model(ids[:, :n], attention_mask=None if mask is None else mask[:, :n], cache=cache)
    return cache


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "separate"])
@pytest.mark.parametrize("config", CONFIGS)
def test_plain_step_equals_recomputation_and_the_modules(config: dict, packed: bool) -> None:
    model = make(**config)
    if not packed:  # deepcopy clones each parameter on its own: one product per projection
        model = copy.deepcopy(model)
    attn = model.blocks[0].attn
    assert (packed_linear(attn.q_proj, attn.k_proj, attn.v_proj) is not None) == packed
    ids = torch.randint(0, V, (2, 12))
    mask = torch.tensor([[1] * 12, [0] * 4 + [1] * 8])  # the second prompt is left-padded
    with torch.inference_mode():
        full = model(ids, attention_mask=mask).logits  # (2, 12, V): no cache at all
        plain_cache, module_cache = prefilled(model, ids, mask, 6), prefilled(model, ids, mask, 6)
        step = PlainDecodeStep.build(model, plain_cache)
        assert step is not None
        plain = torch.stack([step(ids[:, i]) for i in range(6, 12)], 1)  # (2, 6, V)
        modules = torch.stack([model.decode_step(ids[:, i:i + 1], module_cache)
                               for i in range(6, 12)], 1)
    torch.testing.assert_close(plain, full[:, 6:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plain, modules, atol=1e-5, rtol=1e-5)
    # the cache advanced exactly as the modules advance it
    assert plain_cache.seen == module_cache.seen == 12
    assert plain_cache.next_positions.tolist() == module_cache.next_positions.tolist() == [12, 8]
    for mine, theirs in zip(plain_cache.layers, module_cache.layers, strict=True):
        held = 12 if isinstance(mine, KVCache) else 2  # a window of 5 keeps the last 2 keys
        assert mine.seen == theirs.seen and mine.num_keys == theirs.num_keys == held
        if isinstance(mine, KVCache):
            torch.testing.assert_close(mine.keys_values()[0], theirs.keys_values()[0])
        else:
            torch.testing.assert_close(mine._k, theirs._k)
        assert torch.equal(mine._keep, theirs._keep)


def test_plain_step_in_float64_matches_recomputation_closely() -> None:
    model = make(torch.float64, positional="rotary")
    ids = torch.randint(0, V, (1, 10))
    with torch.inference_mode():
        full = model(ids).logits
        cache = prefilled(model, ids, None, 4)
        step = PlainDecodeStep.build(model, cache)
        plain = torch.stack([step(ids[:, i]) for i in range(4, 10)], 1)
    assert plain.dtype == torch.float64
    torch.testing.assert_close(plain, full[:, 4:], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("config", CONFIGS)
def test_generate_gives_the_same_tokens_with_and_without_the_plain_step(config: dict) -> None:
    model = make(**config)
    prompt = torch.randint(0, V, (2, 5))
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    plain = model.generate(prompt, max_new_tokens=20, attention_mask=mask)
    modules = model.generate(prompt, max_new_tokens=20, attention_mask=mask, plain_step=False)
    assert torch.equal(plain, modules)
    # and greedy by recomputing the whole (unpadded) sequence each time
    ids = prompt[:1]
    with torch.no_grad():
        for _ in range(20):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(plain[:1], ids)


@pytest.mark.parametrize(("overrides", "reason"), [
    (dict(attention="strided", stride=3), "StridedAttention"),
    (dict(attention="linear"), "LinearAttention"),
])
def test_other_attention_kinds_stay_on_the_modules(overrides: dict, reason: str) -> None:
    model = make(**overrides)
    ids = torch.randint(0, V, (1, 6))
    with torch.inference_mode():
        cache = prefilled(model, ids, None, 6)
    assert reason in plain_step_refusal(model, cache)
    assert PlainDecodeStep.build(model, cache) is None


def test_torch_forward_hooks_and_training_mode_are_refused() -> None:
    model = make()
    ids = torch.randint(0, V, (1, 6))
    with torch.inference_mode():
        cache = prefilled(model, ids, None, 6)
    assert plain_step_refusal(model, cache) is None
    assert "training" in plain_step_refusal(model.train(), cache)
    model.eval()
    calls = []
    handle = model.blocks[1].mlp.register_forward_hook(lambda *args: calls.append(1))
    try:
        assert "blocks.1.mlp" in plain_step_refusal(model, cache)
        model.generate(ids, max_new_tokens=4)
        assert len(calls) == 4  # the prompt, then 3 steps: all through the modules
    finally:
        handle.remove()
    assert "no decoding cache" in plain_step_refusal(model, None)


def test_handformer_hooks_still_see_every_step_of_generate() -> None:
    """With a hook listening, generate runs the steps through the modules (hook points)."""
    model = make()
    prompt = torch.randint(0, V, (1, 5))
    seen: list[tuple[int, ...]] = []
    with inspect.hooks(model, {"blocks.2.hook_resid_post": lambda x, name: seen.append(
            tuple(x.shape))}):
        out = model.generate(prompt, max_new_tokens=6)
    assert seen == [(1, 5, 16)] + [(1, 1, 16)] * 5
    assert torch.equal(out, model.generate(prompt, max_new_tokens=6))


def test_plain_step_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="plain_step must be True or False, got 1"):
        make().generate(torch.zeros(1, 2, dtype=torch.long), max_new_tokens=2, plain_step=1)


def test_a_subclass_that_overrides_run_keeps_its_own_step() -> None:
    class Doubled(hf.CausalLM):
        def run(self, *args: object, **kwargs: object):  # noqa: ANN202
            logits, weights = super().run(*args, **kwargs)
            return logits * 2, weights

    model = Doubled(make().config).eval()
    ids = torch.randint(0, V, (1, 6))
    with torch.inference_mode():
        cache = prefilled(model, ids, None, 6)
    assert model.plain_decode_step(cache) is None
    assert make().plain_decode_step(prefilled(make(), ids, None, 6)) is not None


def test_a_global_module_hook_sends_every_step_through_the_modules() -> None:
    model = make()
    ids = torch.randint(0, V, (1, 4))
    ff = model.blocks[0].mlp
    calls = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: calls.append(1) if module is ff else None)
    try:
        with torch.inference_mode():
            assert "global" in plain_step_refusal(model, prefilled(model, ids, None, 4))
        calls.clear()
        model.generate(ids, max_new_tokens=3)
    finally:
        handle.remove()
    assert len(calls) == 3  # the prompt, then 2 steps: all through the modules


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 576), (3, 64), (2, 9, 1, 64), (1, 1, 256)])
def test_the_steps_rms_norm_is_torchs_bit_for_bit(shape: tuple, dtype: torch.dtype) -> None:
    """The step writes RMSNorm out in five calls; they are torch.rms_norm's own steps (the
    module path's), so the bits agree, and both are the float64 formula to rounding."""
    torch.manual_seed(0)
    for _ in range(20):
        x = torch.randn(shape, dtype=dtype) * 3
        weight = torch.randn(shape[-1], dtype=dtype)
        mine = _Norm(True, weight, None, 1e-6)(x)
        assert torch.equal(mine, torch.rms_norm(x, (shape[-1],), weight, 1e-6))
        x64, w64 = x.double(), weight.double()
        exact = x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * w64
        torch.testing.assert_close(mine, exact.to(dtype))  # rounding of the dtype


def test_the_plain_step_follows_weights_changed_in_place() -> None:
    """Packed weights are the parameters' own memory: an in-place update (an optimizer step)
    is what the next plain step reads; a replaced parameter ends the packing, and the step
    goes back to one product per projection, with the new values."""
    model = make(positional="rotary", norm="rms", mlp="gated", activation="silu",
                 num_kv_heads=1)
    ids = torch.randint(0, V, (1, 8))
    attn, ff = model.blocks[1].attn, model.blocks[1].mlp
    with torch.no_grad():
        attn.k_proj.weight.mul_(-0.5)
        ff.up_proj.weight.add_(0.25)
    assert packed_linear(attn.q_proj, attn.k_proj, attn.v_proj) is not None
    assert packed_linear(ff.gate_proj, ff.up_proj) is not None
    for _ in range(2):
        with torch.inference_mode():
            full = model(ids).logits[:, 4:]
            step = PlainDecodeStep.build(model, prefilled(model, ids, None, 4))
            plain = torch.stack([step(ids[:, i]) for i in range(4, 8)], 1)
        torch.testing.assert_close(plain, full, atol=1e-5, rtol=1e-5)
        attn.v_proj.weight = torch.nn.Parameter(attn.v_proj.weight.detach() * 2)  # replaced
        assert packed_linear(attn.q_proj, attn.k_proj, attn.v_proj) is None
