"""Projection weights stored back to back (handformer.packing): same values, same modules,
one product; and the layout is found out, never assumed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import handformer as hf
from handformer.layers import GatedFeedForward, MultiHeadAttention
from handformer.packing import pack_linears, packed_linear


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
    assert torch.equal(torch.nn.functional.linear(x, weight, packed_bias),
                       torch.cat([m(x) for m in mods], -1))
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
    attn = again.layers[0].self_attn
    assert packed_linear(attn.q_proj, attn.k_proj, attn.v_proj) is not None
