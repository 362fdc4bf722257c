"""Bare BERT model folders (config.json + model.safetensors, no tokenizer):
``BertModel.save_pretrained`` writes them atomically in Hugging Face's names,
``BertModel.from_pretrained`` loads them (and transformers does too), ``load_bert`` says what
is missing and names the model-only entry point."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers

from handformer import LocalAttention
from handformer.pretrained import BertModel, CheckpointError, bundled_model_dir, load_bert
from handformer.weights import write_atomically
from pretrained_util import state_hash, tiny_checkpoint


@pytest.mark.parametrize("pooler", [True, False])
def test_save_pretrained_round_trip_and_transformers_reads_it(tmp_path: Path,
                                                              pooler: bool) -> None:
    reference = tiny_checkpoint(tmp_path / "hf", pooler=pooler)
    model, _ = load_bert(tmp_path / "hf")
    folder = model.save_pretrained(tmp_path / "bare")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]

    loaded = BertModel.from_pretrained(folder)
    assert not loaded.training and loaded.config == model.config
    assert (loaded.pooler is not None) == pooler
    assert state_hash(loaded) == state_hash(model)

    # transformers reads the folder with no missing or unexpected weights
    theirs, info = transformers.BertModel.from_pretrained(
        folder, add_pooling_layer=pooler, attn_implementation="eager",
        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(0, 64, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    with torch.no_grad():
        want = reference(ids, attention_mask=mask)
        again = theirs.eval()(ids, attention_mask=mask)
    got = loaded(ids, attention_mask=mask)
    for out in (want, again):
        torch.testing.assert_close(got.last_hidden_state, out.last_hidden_state,
                                   atol=1e-5, rtol=1e-5)
        if pooler:
            torch.testing.assert_close(got.pooler_output, out.pooler_output,
                                       atol=1e-5, rtol=1e-5)


def test_from_pretrained_options_match_causal_lm(tmp_path: Path) -> None:
    """device and dtype keywords like CausalLM.from_pretrained; attention like load_bert."""
    tiny_checkpoint(tmp_path)
    (tmp_path / "vocab.txt").unlink()  # a bare transformers folder: no tokenizer at all
    model = BertModel.from_pretrained(tmp_path, device="cpu", dtype=torch.float64,
                                      attention=LocalAttention(3))
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert isinstance(model.blocks[0].attn.attention, LocalAttention)
    also = BertModel.from_pretrained(tmp_path / "model.safetensors")
    assert state_hash(also) == state_hash(BertModel.from_pretrained(tmp_path))
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        BertModel.from_pretrained(tmp_path, dtype=torch.int64)
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        BertModel.from_pretrained(tmp_path / "nowhere")


def test_load_bert_on_a_bare_folder_names_the_missing_files_and_entry_point(
        tmp_path: Path) -> None:
    model, _ = load_bert(bundled_model_dir())
    folder = model.save_pretrained(tmp_path / "bare")
    with pytest.raises(FileNotFoundError) as info:
        load_bert(folder)
    message = str(info.value)
    assert "tokenizer.json or vocab.txt" in message
    assert f"BertModel.from_pretrained({str(folder)!r})" in message
    # the bundled model keeps its sentence-transformers pooling only in its own folder
    bare = BertModel.from_pretrained(folder)
    assert bare.sentence_pooling is None
    enc = load_bert()[1](["a sentence", "another, longer one"])
    torch.testing.assert_close(bare(**enc).last_hidden_state, model(**enc).last_hidden_state,
                               atol=0, rtol=0)
    # with the tokenizer files copied in, load_bert works
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json"):
        shutil.copy(bundled_model_dir() / name, folder / name)
    again, tokenizer = load_bert(folder)
    assert tokenizer.max_length == 512 and state_hash(again) == state_hash(model)


def test_save_pretrained_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save that fails midway leaves the previous files intact and no temporary file."""
    tiny_checkpoint(tmp_path / "hf")
    first, _ = load_bert(tmp_path / "hf")
    folder = first.save_pretrained(tmp_path / "bare")
    files = {p.name: p.read_bytes() for p in folder.iterdir()}
    second = BertModel(first.config)

    import safetensors.torch

    def half_then_crash(tensors, filename, metadata=None):  # noqa: ANN001, ANN202
        Path(filename).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", half_then_crash)
    with pytest.raises(OSError, match="disk full"):
        second.save_pretrained(folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == files
    monkeypatch.undo()
    second.save_pretrained(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    assert state_hash(BertModel.from_pretrained(folder)) == state_hash(second)

    def write_then_fail(tmp: Path) -> None:
        tmp.write_text("new")
        raise RuntimeError("boom")

    target = tmp_path / "x.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError, match="boom"):
        write_atomically(target, write_then_fail)
    assert target.read_text() == "old" and [p.name for p in tmp_path.glob(".x.txt*")] == []


def test_refused_bare_folder_returns_no_model(tmp_path: Path) -> None:
    model, _ = load_bert(bundled_model_dir())
    folder = model.save_pretrained(tmp_path / "bare")
    (folder / "config.json").write_text((folder / "config.json").read_text().replace(
        '"intermediate_size": 1536', '"intermediate_size": 1000'))
    with pytest.raises(CheckpointError, match=r"encoder\.layer\.0\.intermediate\.dense\.weight:"
                                              r" model blocks\.0\.mlp\.linear1\.weight "
                                              r"expects \(1000, 384\), found \(1536, 384\)"):
        BertModel.from_pretrained(folder)
