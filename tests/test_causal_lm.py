"""CausalLM: config validation, forward against an independent re-computation, save/load."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

import handformer as hf
from handformer.weights import CheckpointError

SMALL = dict(vocab_size=37, max_len=24, d_model=16, num_heads=2, num_layers=2, d_ff=32)


def make(**overrides: object) -> hf.CausalLM:
    return hf.CausalLM(hf.CausalLMConfig(**{**SMALL, **overrides})).eval()


@pytest.mark.parametrize("overrides, message", [
    (dict(vocab_size=0), "vocab_size must be a positive integer"),
    (dict(num_heads=3), "d_model=16 is not divisible by num_heads=3"),
    (dict(dropout=1.0), "dropout must be a probability"),
    (dict(activation="swish"), "activation must be one of"),
    (dict(positional="alibi"), "positional must be one of"),
    (dict(attention="sparse"), "attention must be one of"),
    (dict(attention="local"), "window_size must be a positive integer, got None"),
    (dict(attention="strided", stride=0), "stride must be a positive integer, got 0"),
    (dict(window_size=4), "window_size=4 is only used with attention='local'"),
    (dict(positional="rotary", d_model=18, num_heads=2), "needs an even head dim"),
    (dict(tie_weights=1), "tie_weights must be True or False"),
    (dict(layer_norm_eps=0), "layer_norm_eps must be a positive number"),
])
def test_config_validation(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        hf.CausalLMConfig(**{**SMALL, **overrides})


def test_config_dict_round_trip_and_errors() -> None:
    config = hf.CausalLMConfig(**SMALL, positional="rotary", tie_weights=False)
    assert hf.CausalLMConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match=r"unknown CausalLMConfig fields \['n_embd'\]"):
        hf.CausalLMConfig.from_dict({**config.to_dict(), "n_embd": 3})
    data = config.to_dict()
    del data["d_ff"]
    with pytest.raises(ValueError, match=r"missing required fields \['d_ff'\]"):
        hf.CausalLMConfig.from_dict(data)


def reference_logits(model: hf.CausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The pre-LN GPT forward written out in float64 from the model's parameters."""
    c = model.config
    p = {k: v.double() for k, v in model.state_dict().items()}
    B, L = ids.shape
    H, D = c.num_heads, c.head_dim
    x = p["tok_emb.weight"][ids] + p["pos_emb.weight"][:L]
    allowed = torch.ones(L, L, dtype=torch.bool).tril()
    for i in range(c.num_layers):
        pre = f"blocks.{i}."

        def lin(name: str, t: torch.Tensor, pre: str = pre) -> torch.Tensor:
            return t @ p[pre + name + ".weight"].T + p[pre + name + ".bias"]

        h = F.layer_norm(x, (c.d_model,), p[pre + "ln1.weight"], p[pre + "ln1.bias"],
                         c.layer_norm_eps)
        q, k, v = (lin(f"attn.{n}_proj", h).view(B, L, H, D).transpose(1, 2)
                   for n in "qkv")
        scores = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~allowed, -math.inf)
        a = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, L, c.d_model)
        x = x + lin("attn.out_proj", a)
        h = F.layer_norm(x, (c.d_model,), p[pre + "ln2.weight"], p[pre + "ln2.bias"],
                         c.layer_norm_eps)
        x = x + lin("mlp.linear2", F.gelu(lin("mlp.linear1", h)))
    x = F.layer_norm(x, (c.d_model,), p["ln_final.weight"], p["ln_final.bias"], c.layer_norm_eps)
    return x @ p["tok_emb.weight"].T


def test_forward_matches_float64_reference() -> None:
    model = make()
    ids = torch.randint(0, 37, (3, 11))
    out = model(ids, need_weights=True)
    assert out.logits.shape == (3, 11, 37)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (3, 2, 11, 11)
    assert torch.allclose(out.attentions[0].sum(-1), torch.ones(3, 2, 11))
    torch.testing.assert_close(out.logits.double(), reference_logits(model, ids), atol=1e-5,
                               rtol=1e-5)
    assert model.lm_head.weight is model.tok_emb.weight  # tied


def test_left_padding_gives_the_unpadded_logits() -> None:
    model = make()
    ids = torch.randint(0, 37, (1, 7))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.tensor([[0, 0, 0] + [1] * 7])
    alone = model(ids).logits
    together = model(padded, attention_mask=mask).logits[:, 3:]
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad, error, message", [
    (torch.zeros(2, 3), TypeError, "input_ids must be integer token ids"),
    (torch.zeros(3, dtype=torch.long), ValueError, r"input_ids must be \(B, L\)"),
    (torch.full((1, 3), 37), ValueError, r"token ids must be in \[0, 37\)"),
    (torch.zeros(1, 25, dtype=torch.long), ValueError, "exceed the context max_len=24"),
])
def test_forward_bad_inputs(bad: torch.Tensor, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        make()(bad)


def test_bad_attention_mask() -> None:
    model = make()
    with pytest.raises(ValueError, match=r"attention_mask must be \(B, L\)"):
        model(torch.zeros(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="only 0 and 1"):
        model(torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.tensor([[0, 2, 1]]))


@pytest.mark.parametrize("overrides", [
    dict(), dict(tie_weights=False, positional="sinusoidal"),
    dict(positional="rotary", norm_first=False, bias=False),
])
def test_save_and_load_round_trip(tmp_path, overrides: dict) -> None:
    model = make(**overrides)
    model.save_pretrained(tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["config.json",
                                                                  "model.safetensors"]
    loaded = hf.CausalLM.from_pretrained(tmp_path / "m")
    assert loaded.config == model.config and not loaded.training
    ids = torch.randint(0, 37, (2, 9))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)
    assert (loaded.lm_head.weight is loaded.tok_emb.weight) == model.config.tie_weights


def test_failed_loads_raise_and_leave_nothing(tmp_path) -> None:
    make().save_pretrained(tmp_path / "a")
    make(d_ff=48).save_pretrained(tmp_path / "b")
    # config of a, weights of b: mis-shaped feed-forward weights, listed by key.
    (tmp_path / "b" / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"blocks.0.mlp\.linear1\.weight: model "
                                              r"blocks.0.mlp\.linear1\.weight expects \(32, 16\), "
                                              r"found \(48, 16\)"):
        hf.CausalLM.from_pretrained(tmp_path / "b")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        hf.CausalLM.from_pretrained(tmp_path / "missing")
    (tmp_path / "a" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="load_gpt2"):
        hf.CausalLM.from_pretrained(tmp_path / "a")
    weights = tmp_path / "b" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        hf.CausalLM.from_pretrained(tmp_path / "b")


def test_save_leaves_no_temporary_files(tmp_path) -> None:
    model = make()
    model.save_pretrained(tmp_path)
    model.save_pretrained(tmp_path)  # overwrite in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "handformer-causal-lm" and config["d_model"] == 16


def test_logits_to_keep_gives_the_last_positions_only() -> None:
    torch.manual_seed(0)
    model = make(positional="rotary")
    ids = torch.randint(0, 37, (2, 9))
    full = model(ids).logits  # (2, 9, 37)
    for keep in (1, 3, 9):
        part = model(ids, logits_to_keep=keep).logits
        assert part.shape == (2, keep, 37)
        torch.testing.assert_close(part, full[:, -keep:], rtol=1e-6, atol=1e-6)
    assert model(ids, logits_to_keep=0).logits.shape == full.shape
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="logits_to_keep must be a non-negative integer"):
            model(ids, logits_to_keep=bad)


def test_generate_runs_the_lm_head_on_the_prompts_last_token_only() -> None:
    """The prompt's pass asks for one position's logits: the head sees (B, 1, E) rows only
    (no (B, L, E) call), and the tokens are those of recomputing every step."""
    torch.manual_seed(0)
    model = make(positional="rotary")
    ids = torch.randint(0, 37, (2, 7))
    expected = model.generate(ids, max_new_tokens=5, use_cache=False)
    shapes: list[tuple[int, ...]] = []
    handle = model.lm_head.register_forward_hook(lambda m, i, o: shapes.append(i[0].shape))
    try:
        got = model.generate(ids, max_new_tokens=5)
    finally:
        handle.remove()
    assert torch.equal(got, expected)
    assert shapes and all(s[-2] == 1 for s in shapes), shapes
