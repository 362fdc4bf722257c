"""Every failure path of the pretrained loaders, tokenizer and model states its cause."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from handformer import weights as loading_module
from handformer.pretrained import (
    BertConfig,
    BertModel,
    CheckpointError,
    bert_key_map,
    load_bert,
    load_safetensors,
)
from pretrained_util import state_hash, tiny_checkpoint


@pytest.fixture()
def ckpt(tmp_path):
    tiny_checkpoint(tmp_path)
    return tmp_path


def random_model(folder) -> BertModel:
    config = BertConfig.from_dict(json.loads((folder / "config.json").read_text()))
    return BertModel(config)


def rewrite(folder, edit) -> None:
    state = load_file(folder / "model.safetensors")
    edit(state)
    save_file(state, folder / "model.safetensors")


def test_missing_unexpected_and_misshaped_listed_together(ckpt) -> None:
    def edit(state):
        del state["encoder.layer.1.output.dense.bias"]
        state["encoder.layer.0.attention.self.extra.weight"] = torch.zeros(3)
        state["pooler.dense.weight"] = torch.zeros(32, 31)

    rewrite(ckpt, edit)
    model = random_model(ckpt)
    before = state_hash(model)
    with pytest.raises(CheckpointError) as info:
        load_safetensors(model, ckpt / "model.safetensors", bert_key_map(False))
    msg = str(info.value)
    assert "nothing was loaded" in msg
    assert "1 missing keys" in msg  # in the file's name, with handformer's beside it
    assert "encoder.layer.1.output.dense.bias (32,) (model: blocks.1.mlp.linear2.bias)" \
        in msg
    assert "1 unexpected keys" in msg and "encoder.layer.0.attention.self.extra.weight (3,)" in msg
    assert "1 mis-shaped keys" in msg
    assert "pooler.dense.weight: model pooler.dense.weight expects (32, 32), found (32, 31)" in msg
    assert state_hash(model) == before
    with pytest.raises(CheckpointError, match="missing keys"):
        load_bert(ckpt)


def test_config_that_does_not_match_weights(ckpt) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    config["intermediate_size"] = 40
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"mlp.linear1.weight expects \(40, 32\), found "
                                              r"\(37, 32\)"):
        load_bert(ckpt)


def test_truncated_file(ckpt) -> None:
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) - 1000])
    model = random_model(ckpt)
    before = state_hash(model)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_safetensors(model, ckpt / "model.safetensors", bert_key_map(False))
    assert state_hash(model) == before
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_bert(ckpt)


@pytest.mark.parametrize("content", [b"", b"\x00" * 7, b"\xff" * 64,
                                     b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all"])
def test_corrupt_file(tmp_path, content) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_safetensors(nn.Linear(2, 2), path)


def test_file_shrinking_while_loading_leaves_model_untouched(ckpt, monkeypatch) -> None:
    """A read that fails after validation (here: the file is cut after its header was
    checked) still leaves every parameter as it was: tensors are staged before any copy."""
    real = loading_module.read_safetensors_header
    path = ckpt / "model.safetensors"

    def header_then_truncate(p):
        result = real(p)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        return result

    monkeypatch.setattr(loading_module, "read_safetensors_header", header_then_truncate)
    model = random_model(ckpt)
    before = state_hash(model)
    with pytest.raises(CheckpointError, match="truncated"):
        load_safetensors(model, path, bert_key_map(False))
    assert state_hash(model) == before


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.ckpt"])
def test_pickle_checkpoints_are_refused_unopened(tmp_path, name) -> None:
    path = tmp_path / name
    path.write_bytes(b"\x80\x04 this would be a pickle")
    with pytest.raises(CheckpointError, match="is a pickle checkpoint.*refused on purpose.*"
                                              "safetensors"):
        load_safetensors(nn.Linear(2, 2), path)
    with pytest.raises(CheckpointError, match="never opens pickle files"):
        load_bert(path)


def test_folder_with_only_bin_is_refused(ckpt) -> None:
    (ckpt / "model.safetensors").rename(ckpt / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="found pytorch_model.bin but no model.safetensors"
                                              ".*refused on purpose"):
        load_bert(ckpt)


def test_missing_files(tmp_path, ckpt) -> None:
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        load_bert(tmp_path / "nowhere")
    (ckpt / "vocab.txt").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json or vocab.txt.*"
                                                "BertModel.from_pretrained"):
        load_bert(ckpt)
    (ckpt / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_bert(ckpt)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty has no model.safetensors"):
        load_bert(tmp_path / "empty")


@pytest.mark.parametrize("change, match", [
    ({"position_embedding_type": "relative_key"}, "only 'absolute' positions"),
    ({"model_type": "gpt2"}, "BERT-family"),
    ({"is_decoder": True}, "encoders only"),
    ({"hidden_act": "swish"}, "hidden_act must be one of"),
    ({"hidden_size": 30}, "not divisible by num_attention_heads=4"),
])
def test_unsupported_configs(ckpt, change, match) -> None:
    config = json.loads((ckpt / "config.json").read_text()) | change
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        load_bert(ckpt)


def test_generic_loader_dtypes_ties_and_duplicates(tmp_path) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(5, 3)
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight
            self.register_buffer("scale", torch.ones(3))

    path = tmp_path / "m.safetensors"
    weight = torch.randn(5, 3)
    save_file({"emb.weight": weight.half(), "scale": torch.full((3,), 2.0)}, path)
    model = Tied()
    report = load_safetensors(model, path)
    assert model.head.weight is model.emb.weight
    torch.testing.assert_close(model.emb.weight, weight.half().float())
    assert torch.equal(model.scale, torch.full((3,), 2.0))
    assert sorted(report.loaded) == [("emb.weight", "emb.weight"), ("scale", "scale")]

    save_file({"emb.weight": weight, "head.weight": weight.clone(), "scale": torch.ones(3)}, path)
    with pytest.raises(CheckpointError, match="duplicated keys:\n  head.weight and emb.weight "
                                              "both load head.weight"):
        load_safetensors(Tied(), path)
    save_file({"emb.weight": weight.long(), "scale": torch.ones(3)}, path)
    with pytest.raises(CheckpointError, match="dtype I64 cannot load into emb.weight"):
        load_safetensors(Tied(), path)

    save_file({"w": weight, "junk": torch.ones(1), "s": torch.ones(3)}, path)
    model = Tied()
    load_safetensors(model, path, {"w": "emb.weight", "junk": None, "s": "scale"})
    assert torch.equal(model.head.weight, weight)


def test_assign_onto_meta_model(ckpt) -> None:
    config = BertConfig.from_dict(json.loads((ckpt / "config.json").read_text()))
    with torch.device("meta"):
        model = BertModel(config)
    report = load_safetensors(model, ckpt / "model.safetensors", bert_key_map(False),
                              assign=True)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters())
    assert len(report.loaded) == len(model.state_dict())


def test_tokenizer_errors(ckpt) -> None:
    _, tokenizer = load_bert(ckpt)
    with pytest.raises(ValueError, match="text 1 is empty"):
        tokenizer(["the cat", "   "])
    with pytest.raises(TypeError, match="text 0 must be a string, got int"):
        tokenizer([3])
    with pytest.raises(TypeError, match="texts must be a string or a list of strings"):
        tokenizer(None)
    with pytest.raises(ValueError, match="texts is an empty list"):
        tokenizer([])
    with pytest.raises(ValueError, match="got 2 texts but 1 text_pairs"):
        tokenizer(["a", "b"], ["c"])
    with pytest.raises(ValueError, match="text 0 has 82 tokens, more than the limit of 64"):
        tokenizer("the " * 80, truncation=False)
    with pytest.raises(ValueError, match="max_length=100 is above the model's limit of 64"):
        tokenizer("the cat", max_length=100)


def test_model_input_errors(ckpt) -> None:
    model, tokenizer = load_bert(ckpt)
    ids = torch.randint(5, 60, (2, 7))
    with pytest.raises(ValueError, match=r"must be \(B, L\), got shape \(7,\)"):
        model(ids[0])
    with pytest.raises(TypeError, match="integer tensor, got dtype torch.float32"):
        model(ids.float())
    with pytest.raises(ValueError, match="input of 65 tokens is longer than the model's 64"):
        model(torch.ones(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, 64\)"):
        model(ids + 100)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        model(ids, attention_mask=torch.ones(2, 6))
    with pytest.raises(ValueError, match=r"token_type_ids must lie in \[0, 2\)"):
        model(ids, token_type_ids=torch.full_like(ids, 2))
    with pytest.raises(TypeError, match="config must be a BertConfig"):
        BertModel({"hidden_size": 8})


def test_embed_argument_errors(ckpt) -> None:
    from handformer.pretrained import embed

    model, tokenizer = load_bert(ckpt)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        embed(["x"], model=model, tokenizer=tokenizer, batch_size=0)
    with pytest.raises(ValueError, match="model was given without tokenizer"):
        embed(["x"], model=model)
    model.train()
    embed(["the cat"], model=model, tokenizer=tokenizer)
    assert model.training  # restored


def test_transforms_split_a_fused_matrix(tmp_path) -> None:
    """What a GPT-2 loader needs: one stored Conv1D ``(E, 3E)`` matrix -> three Linears."""

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    fused_w, fused_b = torch.randn(4, 12), torch.randn(12)
    path = tmp_path / "attn.safetensors"
    save_file({"c_attn.weight": fused_w, "c_attn.bias": fused_b}, path)

    def key_map(key: str):
        leaf = key.rsplit(".", 1)[1]
        return [(f"{name}.{leaf}", (lambda t, i=i: t[..., 4 * i:4 * i + 4].mT)
                 if leaf == "weight" else (lambda t, i=i: t[4 * i:4 * i + 4]))
                for i, name in enumerate("qkv")]

    model = Attn()
    report = load_safetensors(model, path, key_map)
    assert len(report.loaded) == 6
    for i, lin in enumerate((model.q, model.k, model.v)):
        assert torch.equal(lin.weight, fused_w[:, 4 * i:4 * i + 4].T)
        assert torch.equal(lin.bias, fused_b[4 * i:4 * i + 4])
        assert lin.weight.is_contiguous()

    def wrong(key: str):
        if key.endswith("weight"):
            return [("q.weight", lambda t: t[:, :5]), ("k.weight", lambda t: t.view(5, 5)),
                    ("v.weight", lambda t: t[:, 8:].T)]
        return key_map(key)

    fresh = Attn()
    before = state_hash(fresh)
    with pytest.raises(CheckpointError) as info:
        load_safetensors(fresh, path, wrong)
    msg = str(info.value)
    assert "2 mis-shaped keys" in msg
    assert "c_attn.weight: model q.weight expects (4, 4), found (4, 5) after the key map's" in msg
    assert "model k.weight expects (4, 4), found an error in the transform" in msg
    assert state_hash(fresh) == before
