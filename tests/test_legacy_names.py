"""Folders and runs written before "one name per part" (module paths ``layers.0.self_attn``,
``norm1``...) still load, to the same outputs; the old attribute names still read, with a
warning, and register nothing twice.

The files under ``tests/data/legacy_names/`` were written by main at 008eaea (see its
``make.py``), with the outputs that code computed.
"""

from __future__ import annotations

import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from handformer import CausalLM, Transformer
from handformer.legacy_names import legacy_key_map
from handformer.pretrained import BertConfig, BertModel, load_lm
from handformer.weights import CheckpointError, load_safetensors

DATA = Path(__file__).parent / "data" / "legacy_names"
sys.path.insert(0, str(DATA))
from make import gemma_config, gpt2_config, inputs  # noqa: E402

OLD_SEGMENTS = {"layers", "self_attn", "ff", "norm", "norm1", "norm2", "norm3",
                "post_attn_norm", "post_mlp_norm", "encoder.layers"}


@pytest.fixture(scope="module")
def outputs() -> dict[str, torch.Tensor]:
    return load_file(str(DATA / "outputs.safetensors"))


def _renamed(model: torch.nn.Module, path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors under today's names (the key map applied by hand)."""
    key_map = legacy_key_map(model)
    return {key_map.get(k, k): v for k, v in load_file(str(path)).items()}


def test_the_files_hold_old_names() -> None:
    """The fixtures are what they claim: old keys (else the tests below prove nothing)."""
    keys = set(load_file(str(DATA / "causal_lm_gemma" / "model.safetensors")))
    assert {"layers.0.self_attn.q_proj.weight", "layers.0.norm3.weight",
            "layers.1.post_mlp_norm.weight", "norm.weight"} <= keys
    assert "layers.0.norm2.weight" in load_file(str(DATA / "transformer.safetensors")) \
        or "decoder.layers.0.norm2.weight" in load_file(str(DATA / "transformer.safetensors"))


@pytest.mark.parametrize(("name", "config"), [("causal_lm", gpt2_config),
                                              ("causal_lm_gemma", gemma_config)])
def test_saved_causal_lm_loads_to_the_old_outputs(name: str, config, outputs) -> None:  # noqa: ANN001
    model = CausalLM.from_pretrained(DATA / name)
    fresh = CausalLM(config()).eval()
    result = fresh.load_state_dict(_renamed(fresh, DATA / name / "model.safetensors"),
                                   strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= {"lm_head.weight"}  # tied: stored once, as tok_emb
    ids = inputs()["ids"]
    with torch.no_grad():
        logits = model(ids).logits
        assert torch.equal(logits, fresh(ids).logits)
    torch.testing.assert_close(logits, outputs[name], rtol=0, atol=1e-6)
    loaded, _ = load_lm(DATA / name, tokenizer=False)  # handformer-causal-lm, by load_lm
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, logits)


def test_a_missing_key_is_named_as_today(tmp_path: Path) -> None:
    """An old file without one tensor is refused naming the tensor by its new name."""
    state = load_file(str(DATA / "causal_lm" / "model.safetensors"))
    del state["layers.1.norm3.bias"]
    shutil.copy(DATA / "causal_lm" / "config.json", tmp_path / "config.json")
    from safetensors.torch import save_file
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing keys.*\n  blocks\.1\.ln2\.bias"):
        CausalLM.from_pretrained(tmp_path)


def test_transformer_state_dict_loads(outputs) -> None:  # noqa: ANN001
    """An encoder-decoder state dict: ``norm2`` is ``ln2`` in an encoder layer and
    ``ln_cross`` in a decoder layer; ``load_state_dict`` and ``load_safetensors`` agree."""
    x = inputs()
    old = load_file(str(DATA / "transformer.safetensors"))
    by_state_dict = Transformer(d_model=8, num_heads=2, num_encoder_layers=2,
                                num_decoder_layers=2, d_ff=16, dropout=0.0).eval()
    by_state_dict.load_state_dict(old, strict=True)
    by_file = Transformer(d_model=8, num_heads=2, num_encoder_layers=2, num_decoder_layers=2,
                          d_ff=16, dropout=0.0).eval()
    load_safetensors(by_file, DATA / "transformer.safetensors")
    assert torch.equal(by_file.decoder.blocks[1].ln_cross.weight,
                       old["decoder.layers.1.norm2.weight"])
    assert torch.equal(by_file.encoder.blocks[1].ln2.weight, old["encoder.layers.1.norm2.weight"])
    assert torch.equal(by_file.decoder.ln_final.bias, old["decoder.norm.bias"])
    with torch.no_grad():
        out = by_file(x["src"], x["tgt"]).last_hidden_state
        assert torch.equal(out, by_state_dict(x["src"], x["tgt"]).last_hidden_state)
    torch.testing.assert_close(out, outputs["transformer"], rtol=0, atol=1e-6)


def test_bert_folder_loads(outputs) -> None:  # noqa: ANN001
    """BERT folders hold Hugging Face's names, which did not change."""
    model = BertModel.from_pretrained(DATA / "bert")
    with torch.no_grad():
        hidden = model(inputs()["ids"]).last_hidden_state
    torch.testing.assert_close(hidden, outputs["bert"], rtol=0, atol=1e-6)


def test_bert_state_dict_with_old_keys_loads() -> None:
    """BertModel's own state dict before the rename had ``encoder.layers.{i}.self_attn...``;
    ``load_state_dict`` reads it (the blocks now sit at the top, as TransformerLens'
    HookedEncoder has them)."""
    config = BertConfig(vocab_size=11, hidden_size=8, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=16)
    model = BertModel(config).eval()
    inverse = {new: old for old, new in legacy_key_map(model).items()}
    assert inverse["blocks.1.attn.q_proj.weight"] == "encoder.layers.1.self_attn.q_proj.weight"
    assert inverse["blocks.0.ln2.bias"] == "encoder.layers.0.norm2.bias"
    old = {inverse.get(k, k): v for k, v in model.state_dict().items()}
    again = BertModel(config).eval()
    again.load_state_dict(old, strict=True)
    ids = inputs()["ids"]
    with torch.no_grad():
        assert torch.equal(again(ids).last_hidden_state, model(ids).last_hidden_state)


def test_train_run_loads_and_resumes(tmp_path: Path, outputs) -> None:  # noqa: ANN001
    """A ``handformer train`` run of the old code: its model loads, and it resumes from its
    checkpoint (weights and optimiser state) to a further step."""
    model = CausalLM.from_pretrained(DATA / "run")
    with torch.no_grad():
        torch.testing.assert_close(model(outputs["run_ids"]).logits, outputs["run"],
                                   rtol=0, atol=1e-6)
    run = tmp_path / "run"
    shutil.copytree(DATA / "run", run)
    from handformer.cli import main
    assert main(["train", "--resume", str(run), "--steps", "3", "--no-progress"]) == 0
    assert (run / "checkpoints" / "step-00000003").is_dir()
    resumed = CausalLM.from_pretrained(run)
    assert not torch.equal(resumed.blocks[0].attn.q_proj.weight,
                           model.blocks[0].attn.q_proj.weight)  # it trained one step more


def test_old_attribute_names_warn_and_register_nothing() -> None:
    model = CausalLM(gemma_config())
    layer = model.blocks[0]
    cases = [(model, "layers", model.blocks), (model, "norm", model.ln_final),
             (layer, "self_attn", layer.attn), (layer, "ff", layer.mlp),
             (layer, "norm1", layer.ln1), (layer, "norm3", layer.ln2),
             (layer, "post_attn_norm", layer.ln1_post), (layer, "post_mlp_norm", layer.ln2_post)]
    for owner, old, new in cases:
        with pytest.warns(DeprecationWarning, match=rf"\.{old} is now \."):
            assert getattr(owner, old) is new
    names = {n for path, _ in model.named_modules() for n in path.split(".")}
    names |= {n for key in model.state_dict() for n in key.split(".")}
    assert not names & OLD_SEGMENTS
    mlp = torch.nn.Identity()
    with pytest.warns(DeprecationWarning, match=r"\.ff is now \.mlp"):
        layer.ff = mlp
    assert layer.mlp is mlp and "ff" not in layer._modules
    enc = Transformer(d_model=8, num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
                      d_ff=16)
    with pytest.warns(DeprecationWarning):
        assert enc.decoder.blocks[0].norm2 is enc.decoder.blocks[0].ln_cross
    with pytest.warns(DeprecationWarning):
        assert enc.encoder.blocks[0].norm2 is enc.encoder.blocks[0].ln2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new names never warn
        assert layer.attn is model.blocks[0].attn
