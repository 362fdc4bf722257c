"""Projection weights stored back to back (handformer.packing): same values, same modules,
one product (equal to the modules' products up to float rounding); and the layout is found
out, never assumed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import handformer as hf
from handformer.layers import GatedFeedForward, MultiHeadAttention
from handformer.packing import empty_packed, pack_linears, packed_linear


def linears(*outs: int, bias: bool = True, d: int = 8) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(d, n, bias=bias) for n in outs]


@pytest.mark.parametrize("bias", [True, False])
def test_packing_keeps_values_and_one_product_equals_each_module(bias: bool) -> None:
    mods = linears(6, 2, 2, bias=bias)
    before = [(m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone())
              for m in mods]
    pack_linears(*mods)
    for m, (w, b) in zip(mods, before, strict=True):
        assert isinstance(m.weight, nn.Parameter) and m.weight.requires_grad
        assert torch.equal(m.weight, w) and (b is None or torch.equal(m.bias, b))
    weight, packed_bias = packed_linear(*mods)
    assert weight.shape == (10, 8) and (packed_bias is None) == (not bias)
    x = torch.randn(3, 8)
    packed = torch.nn.functional.linear(x, weight, packed_bias)  # (3, 10)
    # The same dot products; the BLAS may sum them in another order for another matrix
    # shape (MKL does for these tiny ones on some CPUs), so equal to float32 rounding.
    torch.testing.assert_close(packed, torch.cat([m(x) for m in mods], -1),
                               rtol=1e-6, atol=1e-6)
    exact = torch.cat([x.double() @ m.weight.double().T
                       + (0 if m.bias is None else m.bias.double()) for m in mods], -1)
    torch.testing.assert_close(packed.double(), exact, rtol=1e-6, atol=1e-6)
    # the packed weight is the modules' memory, not a copy
    assert weight.data_ptr() == mods[0].weight.data_ptr()


def test_the_order_of_the_modules_matters() -> None:
    q, k, v = linears(6, 2, 2)
    pack_linears(q, k, v)
    assert packed_linear(q, k, v) is not None
    assert packed_linear(k, q, v) is None  # k does not start where q's rows would end...
    assert packed_linear(q, v) is None  # ... nor v where q ends
    assert packed_linear(k, v) is not None  # a tail of the pack is packed too


@pytest.mark.parametrize("change", ["to float64", "new parameter", "deepcopy"])
def test_a_broken_layout_is_seen(change: str) -> None:
    mods = linears(4, 4)
    pack_linears(*mods)
    if change == "to float64":
        mods = [m.to(torch.float64) for m in mods]
    elif change == "new parameter":
        mods[1].weight = nn.Parameter(mods[1].weight.detach().clone())
    else:
        import copy
        mods = copy.deepcopy(mods)
    assert packed_linear(*mods) is None


def test_what_cannot_be_packed_is_left_alone() -> None:
    mixed = [nn.Linear(8, 4, bias=True), nn.Linear(8, 4, bias=False)]  # one bias, one not
    sizes = [nn.Linear(8, 4), nn.Linear(6, 4)]  # different inputs
    dtypes = [nn.Linear(8, 4), nn.Linear(8, 4).double()]
    for mods in (mixed, sizes, dtypes):
        ptrs = [m.weight.data_ptr() for m in mods]
        pack_linears(*mods)
        assert [m.weight.data_ptr() for m in mods] == ptrs
        assert packed_linear(*mods) is None


def test_modules_are_built_packed_and_train_so() -> None:
    attn = MultiHeadAttention(16, 4, num_kv_heads=2)
    ff = GatedFeedForward(16, 24)
    assert packed_linear(attn.q_proj, attn.k_proj, attn.v_proj) is not None
    assert packed_linear(ff.gate_proj, ff.up_proj) is not None
    params = list(attn.parameters()) + list(ff.parameters())
    assert len(params) == len({id(p) for p in params})  # each parameter once
    opt = torch.optim.AdamW(params, lr=0.1)
    x = torch.randn(2, 5, 16)
    before = attn.k_proj.weight.detach().clone()
    ff(attn(x, x, x)[0]).pow(2).mean().backward()
    opt.step()
    assert not torch.equal(attn.k_proj.weight, before)  # trained ...
    assert packed_linear(attn.q_proj, attn.k_proj, attn.v_proj) is not None  # ... still packed
    weight, _ = packed_linear(attn.q_proj, attn.k_proj, attn.v_proj)
    assert torch.equal(weight[16:24], attn.k_proj.weight)


def test_a_packed_model_saves_and_loads_the_same_tensors(tmp_path) -> None:
    config = hf.CausalLMConfig(vocab_size=20, max_len=16, d_model=16, num_heads=4,
                               num_layers=2, d_ff=24, norm="rms", mlp="gated",
                               activation="silu", positional="rotary", num_kv_heads=2)
    model = hf.CausalLM(config).eval()
    model.save_pretrained(tmp_path)
    again = hf.CausalLM.from_pretrained(tmp_path).eval()
    state, loaded = model.state_dict(), again.state_dict()
    assert state.keys() == loaded.keys()
    assert all(torch.equal(state[k], loaded[k]) for k in state)
    attn = again.blocks[0].attn
    assert packed_linear(attn.q_proj, attn.k_proj, attn.v_proj) is not None


@pytest.mark.parametrize("bias", [False, True])
def test_empty_packed_gives_a_layout_the_step_recognises(bias: bool) -> None:
    with torch.device("meta"):  # a loader's modules: shapes only
        group = [nn.Linear(8, n, bias=bias) for n in (6, 2, 2)]
    params = [m.weight for m in group] + ([m.bias for m in group] if bias else [])
    pairs = empty_packed(*group, dtype=torch.float64, device="cpu")
    assert len(pairs) == len(params)  # each parameter once, weights first
    assert all(p is q for (p, _), q in zip(pairs, params, strict=True))
    real = [nn.Linear(8, n, bias=bias, dtype=torch.float64) for n in (6, 2, 2)]
    sources = [m.weight for m in real] + ([m.bias for m in real] if bias else [])
    for i, ((param, view), source) in enumerate(zip(pairs, sources, strict=True)):
        assert view.shape == param.shape and view.dtype == torch.float64
        view.copy_(source.detach())
        setattr(group[i % 3], "weight" if i < 3 else "bias", nn.Parameter(view))
    packed = packed_linear(*group)
    assert packed is not None  # back to back in one storage
    h = torch.randn(4, 8, dtype=torch.float64)
    expected = torch.cat([m(h) for m in real], -1)
    torch.testing.assert_close(torch.nn.functional.linear(h, *packed), expected, rtol=0, atol=1e-12)


def test_empty_packed_refuses_what_cannot_be_packed() -> None:
    mixed = [nn.Linear(8, 4, bias=True), nn.Linear(8, 4, bias=False)]
    assert empty_packed(*mixed, dtype=torch.float32, device="cpu") == []
    assert empty_packed(nn.Linear(8, 4), dtype=torch.float32, device="cpu") == []
