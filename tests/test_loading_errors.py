"""A refused checkpoint names every problem in the file's own key names; pickle-only folders
say why they are refused and how to convert them (and the conversion they name works).

Every loader is covered: ``load_bert`` / ``BertModel.from_pretrained``, ``load_gpt2``,
``CausalLM.from_pretrained`` and training checkpoints. After every refusal the target's
parameters are unchanged.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import handformer as hf
from handformer.pretrained import (
    BertConfig,
    BertModel,
    CheckpointError,
    bert_key_map,
    load_bert,
    load_gpt2,
    load_safetensors,
)
from handformer.train.checkpoint import load_checkpoint, save_checkpoint
from pretrained_util import state_hash, tiny_checkpoint


def rewrite(path: Path, edit) -> None:  # noqa: ANN001 - a function editing a state dict
    state = load_file(path)
    edit(state)
    save_file(state, path)


def section(message: str, title: str) -> list[str]:
    """The lines of one titled group of a CheckpointError message ("N missing keys ...")."""
    m = re.search(rf"^\d+ {re.escape(title)}[^\n]*:\n((?:  [^\n]*\n?)*)", message, re.M)
    assert m, f"no '{title}' group in:\n{message}"
    return [line.strip() for line in m.group(1).splitlines()]


@pytest.mark.parametrize("masked_lm", [False, True], ids=["BertModel", "BertForMaskedLM"])
def test_bert_refusal_names_every_problem_in_file_names(tmp_path: Path, masked_lm: bool) -> None:
    tiny_checkpoint(tmp_path, masked_lm=masked_lm)
    p = "bert." if masked_lm else ""
    weights = tmp_path / "model.safetensors"

    def edit(state: dict) -> None:
        del state[p + "encoder.layer.0.output.dense.bias"]
        del state[p + "embeddings.LayerNorm.weight"]
        del state[p + "encoder.layer.1.attention.self.query.weight"]
        state[p + "encoder.layer.0.attention.self.extra.weight"] = torch.zeros(3)
        state[p + "encoder.layer.1.intermediate.dense.weight"] = torch.zeros(36, 32)

    rewrite(weights, edit)
    for load in (load_bert, BertModel.from_pretrained):
        with pytest.raises(CheckpointError) as info:
            load(tmp_path)
        message = str(info.value)
        assert "nothing was loaded" in message
        # missing keys: the file's own names, handformer's beside them
        assert section(message, "missing keys") == [
            f"{p}embeddings.LayerNorm.weight (32,) (model: embeddings.norm.weight)",
            f"{p}encoder.layer.0.output.dense.bias (32,) (model: blocks.0.mlp.linear2.bias)",
            f"{p}encoder.layer.1.attention.self.query.weight (32, 32) "
            "(model: blocks.1.attn.q_proj.weight)",
        ]
        assert section(message, "unexpected keys") == [
            f"{p}encoder.layer.0.attention.self.extra.weight (3,)"
            + (" (mapped to encoder.layer.0.attention.self.extra.weight)" if p else "")]
        assert section(message, "mis-shaped keys") == [
            f"{p}encoder.layer.1.intermediate.dense.weight: model "
            "blocks.1.mlp.linear1.weight expects (37, 32), found (36, 32)"]
        # the groups come in this order
        order = [message.index(t) for t in ("missing keys", "unexpected keys", "mis-shaped")]
        assert order == sorted(order)

    # all-or-nothing: a model that is refused keeps every parameter
    config = BertConfig.from_dict(json.loads((tmp_path / "config.json").read_text()))
    model = BertModel(config, add_pooling_layer=not masked_lm)
    before = state_hash(model)
    with pytest.raises(CheckpointError, match="3 missing keys"):
        load_safetensors(model, weights, bert_key_map(masked_lm))
    assert state_hash(model) == before
    from handformer.weights import checkpoint_problems

    assert checkpoint_problems(model, weights, bert_key_map(masked_lm))[0].startswith(
        "3 missing keys")


@pytest.mark.parametrize("prefixed", [False, True])
def test_bert_key_map_inverse_gives_transformers_names(prefixed: bool) -> None:
    """file_key(model key) is the name transformers gives the same tensor, and maps back."""
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=24,
                                     max_position_embeddings=20)
    reference = (transformers.BertForMaskedLM(config) if prefixed
                 else transformers.BertModel(config))
    ours = BertModel(BertConfig.from_dict(config.to_dict()), add_pooling_layer=not prefixed)
    key_map = bert_key_map(prefixed)
    ours_in_file_names = {key_map.file_key(k) for k in ours.state_dict()}
    theirs = {k for k in reference.state_dict()
              if not k.startswith("cls.") and not k.endswith(("position_ids", "token_type_ids"))}
    assert ours_in_file_names == theirs
    assert all(key_map(key_map.file_key(k)) == k for k in ours.state_dict())


def save_gpt2(folder: Path, *, base: bool = False, **options: object) -> None:
    settings = dict(vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    config = transformers.GPT2Config(**{**settings, **options})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = (transformers.GPT2Model if base else transformers.GPT2LMHeadModel)(config)
        model.save_pretrained(folder, safe_serialization=True)


@pytest.mark.parametrize("base", [False, True], ids=["GPT2LMHeadModel", "GPT2Model"])
def test_gpt2_refusal_names_every_problem_in_file_names(tmp_path: Path, base: bool) -> None:
    save_gpt2(tmp_path, base=base)
    p = "" if base else "transformer."

    def edit(state: dict) -> None:
        del state[p + "h.0.attn.c_attn.bias"]
        del state[p + "ln_f.weight"]
        state[p + "h.1.mlp.c_fc.weight"] = torch.zeros(16, 60)
        state[p + "h.1.attn.rotary.weight"] = torch.zeros(2)

    rewrite(tmp_path / "model.safetensors", edit)
    with pytest.raises(CheckpointError) as info:
        load_gpt2(tmp_path, tokenizer=False)
    message = str(info.value)
    via = "" if p else " (model: transformer.{})"
    assert section(message, "missing keys") == [
        f"{p}h.0.attn.c_attn.bias (48,)" + via.format("h.0.attn.c_attn.bias"),
        f"{p}ln_f.weight (16,)" + via.format("ln_f.weight"),
    ]
    assert section(message, "unexpected keys")[0].startswith(f"{p}h.1.attn.rotary.weight (2,)")
    assert section(message, "mis-shaped keys") == [
        f"{p}h.1.mlp.c_fc.weight: model transformer.h.1.mlp.c_fc.weight expects (16, 64), "
        "found (16, 60)"]


def test_causal_lm_refusal_lists_every_problem_and_changes_nothing(tmp_path: Path) -> None:
    config = hf.CausalLMConfig(vocab_size=23, max_len=16, d_model=8, num_heads=2,
                               num_layers=2, d_ff=16)
    folder = hf.CausalLM(config).save_pretrained(tmp_path / "lm")

    def edit(state: dict) -> None:
        del state["blocks.1.ln1.bias"]
        del state["ln_final.weight"]
        state["blocks.0.mlp.linear2.weight"] = torch.zeros(8, 12)
        state["blocks.0.attn.k_proj.weight"] = torch.zeros(4, 8)
        state["head.extra"] = torch.zeros(1)

    rewrite(folder / "model.safetensors", edit)
    with pytest.raises(CheckpointError) as info:
        hf.CausalLM.from_pretrained(folder)
    message = str(info.value)
    assert section(message, "missing keys") == ["blocks.1.ln1.bias (8,)", "ln_final.weight (8,)"]
    assert section(message, "unexpected keys") == ["head.extra (1,)"]
    assert section(message, "mis-shaped keys") == [
        "blocks.0.attn.k_proj.weight: model blocks.0.attn.k_proj.weight expects "
        "(8, 8), found (4, 8)",
        "blocks.0.mlp.linear2.weight: model blocks.0.mlp.linear2.weight expects (8, 16), "
        "found (8, 12)"]
    target = hf.CausalLM(config)
    before = state_hash(target)
    with pytest.raises(CheckpointError, match="2 missing keys"):
        load_safetensors(target, folder / "model.safetensors")
    assert state_hash(target) == before


def test_training_checkpoint_refusal_names_weights_and_optimiser_state(tmp_path: Path) -> None:
    """A checkpoint of another shape (its config claimed equal, as after a code change) is
    refused with every mis-shaped weight and optimiser moment named, and nothing changes."""
    def model_and_optimizer(d_ff: int) -> tuple[hf.CausalLM, torch.optim.Optimizer]:
        model = hf.CausalLM(hf.CausalLMConfig(vocab_size=11, max_len=8, d_model=8,
                                              num_heads=2, num_layers=1, d_ff=d_ff))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randint(0, 11, (2, 8))).logits.sum().backward()
        opt.step()
        return model, opt

    source, source_opt = model_and_optimizer(24)
    ckpt = save_checkpoint(tmp_path / "run", 1, source, source_opt, {}, {})
    target, target_opt = model_and_optimizer(16)
    before = (state_hash(target), repr(target_opt.state_dict()))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(ckpt, target, target_opt, json.loads((ckpt / "config.json").read_text()))
    message = str(info.value)
    assert "nothing was loaded" in message
    assert section(message, "mis-shaped keys") == [
        "blocks.0.mlp.linear1.bias: model blocks.0.mlp.linear1.bias expects (16,), found (24,)",
        "blocks.0.mlp.linear1.weight: model blocks.0.mlp.linear1.weight expects (16, 8), "
        "found (24, 8)",
        "blocks.0.mlp.linear2.weight: model blocks.0.mlp.linear2.weight expects (8, 16), "
        "found (8, 24)"]
    optimiser = section(message, "optimiser state mismatches")
    assert len(optimiser) == 6  # exp_avg and exp_avg_sq of the three parameters, by name
    assert "blocks.0.mlp.linear1.weight: exp_avg is (24, 8), the parameter is (16, 8)" in optimiser
    assert (state_hash(target), repr(target_opt.state_dict())) == before


# ---- pickle-only folders ---------------------------------------------------------------------


def conversion_snippets(message: str) -> list[str]:
    return re.findall(r"`([^`]+)`", message)


def test_bert_folder_with_only_pytorch_model_bin(tmp_path: Path) -> None:
    reference = tiny_checkpoint(tmp_path / "ref")
    folder = tmp_path / "bin"
    shutil.copytree(tmp_path / "ref", folder)
    (folder / "model.safetensors").unlink()
    torch.save(reference.state_dict(), folder / "pytorch_model.bin")  # what older tools wrote
    for load in (load_bert, BertModel.from_pretrained):
        with pytest.raises(CheckpointError) as info:
            load(folder)
        message = str(info.value)
        assert f"{folder}: found pytorch_model.bin but no model.safetensors" in message
        assert "refused on purpose" in message and "arbitrary code" in message
    # the conversion the message names works, and then the folder loads
    transformers_snippet = conversion_snippets(message)[0]
    assert "save_pretrained" in transformers_snippet and "safe_serialization=True" in \
        transformers_snippet
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(transformers_snippet, {})  # noqa: S102 - the snippet handformer prints
    model, _ = load_bert(folder)
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        expected = reference(ids).last_hidden_state
    torch.testing.assert_close(model(ids).last_hidden_state, expected, atol=1e-5, rtol=1e-5)


def test_causal_lm_folder_with_only_a_state_dict_bin(tmp_path: Path) -> None:
    config = hf.CausalLMConfig(vocab_size=23, max_len=16, d_model=8, num_heads=2,
                               num_layers=1, d_ff=16, tie_weights=False)
    source = hf.CausalLM(config)
    folder = source.save_pretrained(tmp_path / "lm")
    (folder / "model.safetensors").unlink()
    torch.save(source.state_dict(), folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="found pytorch_model.bin but no "
                                              "model.safetensors") as info:
        hf.CausalLM.from_pretrained(folder)  # (before: "no safetensors file at ...")
    state_dict_snippet = conversion_snippets(str(info.value))[1]
    assert "weights_only=True" in state_dict_snippet
    exec(state_dict_snippet, {})  # noqa: S102 - the snippet handformer prints
    loaded = hf.CausalLM.from_pretrained(folder)
    assert state_hash(loaded) == state_hash(source)


def test_gpt2_folder_with_only_pytorch_model_bin(tmp_path: Path) -> None:
    save_gpt2(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04 never opened")
    with pytest.raises(CheckpointError, match="found pytorch_model.bin but no model.safetensors"
                                              r"\. pytorch_model.bin is a pickle checkpoint"):
        load_gpt2(tmp_path)
