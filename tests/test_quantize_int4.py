"""4-bit weights (``load_lm(..., quantize="int4")``, handformer.models.int4).

The format against ``gguf.quants``' own Q4_1 (a Q4_1 weight's 4-bit values come back, up to
the bfloat16 rounding of each group's scale and zero), the product against float64, a tiny
Llama with int4 and int8 layers side by side (generation with the plain step, the modules and
a full recompute), the shipped SmolLM2 against float32 on three prompts, and the refusals.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from safetensors.torch import save_file
from torch import nn

from handformer.models.int4 import (
    GROUP,
    PROMPT_ROWS,
    Int4Linear,
    int4_eligible,
    quantize_int4,
    unpack_int4,
)
from handformer.models.int8_model import int4_names, quantize_model
from handformer.models.quantized import Int8Linear, check_quantize
from handformer.pretrained import load_lm

_BF16_STEP = 2.0 ** -8  # bfloat16 rounds to 8 significant bits: a relative error <= 2^-8


def _q4_1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` through llama.cpp's Q4_1 (``gguf.quants``): its dequantized values, and each
    group's step ``d`` and minimum (float64, ``(N, K / 32)``), read from those values."""
    raw = quants.quantize(w.numpy().astype(np.float32), GGMLQuantizationType.Q4_1)
    values = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_1).copy())
    groups = values.double().reshape(w.shape[0], -1, GROUP)
    lo, hi = groups.amin(-1), groups.amax(-1)
    return values.float(), (hi - lo) / 15, lo


def test_a_q4_1_weight_keeps_its_4_bit_values():
    """Each group's values are ``d q + m``: int4 gets ``q`` back, so its error is only the
    rounding of ``s = d`` and ``z = m + 8 d`` to bfloat16 (``w = (q - 8) s + z`` is off by
    ``q (s - d)`` plus ``z``'s own rounding), below a quarter step ``d / 4`` (a 4-bit grid
    of its own would be off by up to half a step)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 128, generator=g)
    values, d, lo = _q4_1(w)
    layer = Int4Linear(values)
    err = (layer.weight.double() - values.double()).abs().reshape(64, -1, GROUP)  # (N, G, 32)
    bound = _BF16_STEP * (15 * d + (lo + 8 * d).abs()) + 1e-6  # (N, G)
    assert bool((err <= bound[..., None]).all()), float((err / bound[..., None]).max())
    assert bool((err <= d[..., None] / 4).all())  # the values, not a grid of its own


def test_groups_on_a_coarser_grid_keep_their_values():
    """Q4_K's scales are fitted, so a group's values ``s q + c`` need not span all of 0..15;
    and Q4_0 (``d (q - 8)``, ``gguf.quants``) groups often miss an end. Both lie on a grid of
    fewer steps between their extremes, which int4 finds: the values come back up to the
    rounding of ``s`` and ``z`` (15 steps from minimum to maximum would round them again,
    off by up to half such a step)."""
    g = torch.Generator().manual_seed(9)
    q = torch.randint(2, 12, (64, 128), generator=g).double()  # 4-bit values in 2..11
    s = torch.rand(64, 4, 1, generator=g, dtype=torch.float64) * 0.01 + 0.001  # (N, G, 1)
    c = torch.randn(64, 4, 1, generator=g, dtype=torch.float64) * 0.01
    narrow = (q.reshape(64, 4, GROUP) * s + c).reshape(64, 128).float()
    raw = quants.quantize(torch.randn(64, 128, generator=g).numpy(), GGMLQuantizationType.Q4_0)
    q4_0 = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_0).copy()).float()
    for values in (narrow, q4_0):
        groups = values.double().reshape(64, -1, GROUP)
        lo, hi = groups.amin(-1), groups.amax(-1)
        gaps = (groups[..., :, None] - groups[..., None, :]).abs()  # (N, G, 32, 32)
        spacing = gaps.masked_fill(gaps < 1e-9, float("inf")).amin(dim=(-1, -2))  # (N, G)
        err = (Int4Linear(values).weight.double() - values.double()).abs().reshape(64, -1, GROUP)
        bound = _BF16_STEP * (15 * (hi - lo) + lo.abs() + hi.abs()) + 1e-6  # (N, G)
        assert bool((err <= bound[..., None]).all()), float((err / bound[..., None]).max())
        assert bool((err.amax(-1) < spacing / 4).all())  # the values, not 15 steps of its own


def test_the_product_is_within_bfloat16_of_float64():
    g = torch.Generator().manual_seed(4)
    layer = Int4Linear(torch.randn(64, 96, generator=g), torch.randn(64, generator=g))
    x = torch.randn(5, 96, generator=g) * torch.logspace(-2, 1, 96)
    out = layer(x)
    w = layer.weight.double()  # the 4-bit weight, dequantized
    ref = x.double() @ w.T + layer.bias.double()
    # inputs and dequantized weights rounded to bfloat16, the sum rounded once more
    bound = 2 * _BF16_STEP * (x.double().abs() @ w.abs().T) + _BF16_STEP * ref.abs() + 1e-4
    assert out.dtype == torch.float32 and out.shape == (5, 64)
    assert bool(((out.double() - ref).abs() <= bound).all())


def test_the_packed_layout_unpacks_to_the_values():
    """:func:`unpack_int4` reads torch's packed layout back (several blocks of 64 rows), and
    a prompt's product (the weight unpacked, a bfloat16 matrix product) gives the kernel's
    numbers up to bfloat16 rounding."""
    g = torch.Generator().manual_seed(8)
    q = torch.randint(0, 16, (192, 96), dtype=torch.int32, generator=g)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    assert torch.equal(unpack_int4(packed, 192, 96).int(), q)
    layer = Int4Linear(torch.randn(192, 96))
    x = torch.randn(PROMPT_ROWS, 96)
    with torch.inference_mode():
        prompt = layer(x)  # unpacked: torch.mm in bfloat16
        rows = torch.cat([layer(x[i:i + 8]) for i in range(0, PROMPT_ROWS, 8)])  # the kernel
    ref = x.double() @ layer.weight.double().T
    bound = 2 * _BF16_STEP * (x.double().abs() @ layer.weight.double().abs().T) + 1e-4
    assert bool(((prompt.double() - ref).abs() <= bound).all())
    assert bool(((rows.double() - ref).abs() <= bound).all())


def test_groups_of_projections_and_the_kernel_s_shapes():
    g = torch.Generator().manual_seed(5)
    ws = [torch.randn(n, 64, generator=g) for n in (64, 32, 32)]
    q, k, v = Int4Linear.group(ws, [None, torch.randn(32, generator=g), None])
    x = torch.randn(3, 64, generator=g)
    whole = Int4Linear(torch.cat(ws))  # the same matrix as one layer
    start = 0
    for layer, w in zip((q, k, v), ws, strict=True):
        rows = slice(start, start + len(w))
        assert torch.equal(layer.weight, whole.weight[rows])
        bias = 0 if layer.bias is None else layer.bias
        assert torch.equal(layer(x), whole(x)[:, rows] + bias)  # one packed product
        start += len(w)
    flat = torch.randn(64, 64, generator=g)
    flat[0, :32], flat[1, 32:], flat[2, :32] = 1e-3, 0.0, -5.0  # constant groups
    back = Int4Linear(flat).weight
    torch.testing.assert_close(back[0, :32], flat[0, :32], rtol=_BF16_STEP, atol=0)
    assert bool((back[1, 32:] == 0).all())
    torch.testing.assert_close(back[2, :32], flat[2, :32], rtol=_BF16_STEP, atol=0)
    assert int4_eligible(64, 32) and not int4_eligible(16, 32) and not int4_eligible(64, 48)
    with pytest.raises(ValueError, match=r"int4 needs .* in a multiple of 32 .* \(64, 48\)"):
        quantize_int4(torch.randn(64, 48))
    bad = torch.randn(64, 32)
    bad[3, 4] = float("nan")
    with pytest.raises(ValueError, match="inf or NaN"):
        Int4Linear(bad)
    with pytest.raises(ValueError, match=r"one of \['int8', 'int4'\], got 'int3'"):
        check_quantize("int3")
    with pytest.raises(ValueError, match="dtype must be float32"):
        check_quantize("int4", torch.bfloat16)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose down projection (48 inputs) the 4-bit kernel cannot take."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=61, hidden_size=64, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32, tie_word_embeddings=False)
    folder = tmp_path_factory.mktemp("llama_int4")
    model = LlamaForCausalLM(config).eval()
    config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(folder / "model.safetensors"))
    return folder


def test_a_model_mixes_int4_and_int8_layers_and_generates(llama_dir: Path):
    fp, _ = load_lm(llama_dir, tokenizer=False)
    q, _ = load_lm(llama_dir, tokenizer=False, quantize="int4")
    kinds = {n: type(m).__name__ for n, m in q.named_modules() if isinstance(m, Int8Linear)}
    assert kinds["blocks.0.attn.q_proj"] == kinds["blocks.0.attn.out_proj"] == "Int4Linear"
    assert kinds["blocks.0.mlp.up_proj"] == "Int8Linear"  # gate and up: 96 outputs
    assert kinds["blocks.0.mlp.down_proj"] == "Int8Linear"  # 48 inputs
    assert kinds["lm_head"] == "Int8Linear"
    assert int4_names(fp, {"blocks.0.attn.k_proj"}).isdisjoint(  # a group: all or none
        {"blocks.0.attn.q_proj", "blocks.0.attn.k_proj", "blocks.0.attn.v_proj"})
    ids = torch.tensor([[3, 14, 15, 9, 26]])
    with torch.inference_mode():
        ref, out = fp(ids).logits, q(ids).logits
        assert float((out - ref).abs().max()) < 0.2 * float(ref.abs().max())  # 4 bits
        torch.testing.assert_close(quantize_model(fp, "int4")(ids).logits, out)
        cached = q.generate(ids, max_new_tokens=6)  # the plain decoding step
        modules = q.generate(ids, max_new_tokens=6, plain_step=False)
        full = q.generate(ids, max_new_tokens=6, use_cache=False)
    assert torch.equal(cached, full) and torch.equal(modules, full)


def test_smollm2_int4_agrees_with_float32(smollm2, smollm2_file):
    """SmolLM2's file is Q4_1: its layers keep the file's 4-bit values, so int4 differs from
    the float32 model (the same values, dequantized) by bfloat16 activations alone."""
    from test_quantize import PROMPTS

    fp, tok = smollm2
    q4, _ = load_lm(smollm2_file, tokenizer=False, quantize="int4")
    layers = [m for n, m in q4.named_modules() if n.startswith("blocks.")
              and isinstance(m, Int8Linear)]
    assert len(layers) == 7 * 30 and all(type(m) is Int4Linear for m in layers)
    same = total = 0
    for text in PROMPTS.values():
        ids = torch.tensor([tok.encode(text)])
        with torch.inference_mode():
            ref, out = fp(ids).logits[0], q4(ids).logits[0]
        same += int((ref.argmax(-1) == out.argmax(-1)).sum())
        total += len(ref)
    assert same / total >= 0.95, same / total
    w4, w = q4.blocks[5].mlp.down_proj.weight, fp.blocks[5].mlp.down_proj.weight
    assert float((w4 - w).abs().max()) < 0.02 * float(w.abs().max())  # the file's values


def test_a_copy_shares_the_4_bit_weights():
    import copy

    layer = Int4Linear(torch.randn(64, 64), torch.randn(64))
    other = copy.deepcopy(nn.Sequential(layer))[0]
    assert other._group is layer._group and other.bias is not layer.bias
    assert "4-bit weights in groups of 32" in repr(layer)


def test_gradients_reach_the_activations_through_quantized_layers(llama_dir: Path):
    """Attribution patching differentiates a metric through every layer: an int8 or int4
    layer passes ``dL/dy W~`` back (its dequantized weight), and the estimate on the
    quantized model stays close to float32's."""
    from handformer.inspect import attribution_patching

    g = torch.Generator().manual_seed(11)
    for layer in (Int8Linear(torch.randn(64, 64, generator=g), torch.randn(64, generator=g)),
                  Int4Linear(torch.randn(64, 64, generator=g))):
        x = torch.randn(2, 3, 64, generator=g, requires_grad=True)
        c = torch.randn(2, 3, 64, generator=g)
        (layer(x) * c).sum().backward()
        torch.testing.assert_close(x.grad, c @ layer.weight)
    clean, corrupted = torch.tensor([[3, 14, 15, 9, 26, 5]]), torch.tensor([[3, 14, 40, 9, 26, 5]])

    def metric(out: object) -> torch.Tensor:
        return out.logits[0, -1, 7] - out.logits[0, -1, 8]

    fp, _ = load_lm(llama_dir, tokenizer=False)
    ref = attribution_patching(fp, clean, corrupted, metric)
    for quantize in ("int8", "int4"):
        q, _ = load_lm(llama_dir, tokenizer=False, quantize=quantize)
        got = attribution_patching(q, clean, corrupted, metric)
        assert got.shape == ref.shape and bool(torch.isfinite(got).all())
        assert float((got - ref).abs().max()) < 0.25 * float(ref.abs().max()), quantize
