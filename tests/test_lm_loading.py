"""load_lm's loading side: the strict loader, file layouts, shards and refusals.

Checkpoints are written here by transformers (tiny random Llama / Gemma 3 models) or edited
copies of them; nothing is downloaded.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

import handformer as hf  # noqa: E402
from handformer.pretrained import CheckpointError, load_gpt2, load_lm  # noqa: E402
from handformer.pretrained.families import (  # noqa: E402
    FAMILIES,
    ConfigFieldError,
    family_for,
    supported_model_types,
)
from handformer.pretrained.lm import build_causal_lm, is_causal_source  # noqa: E402

V = 61


def _llama_config(**changes: object) -> object:
    base = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    return transformers.LlamaConfig(**{**base, **changes})


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_llama_config()).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gemma3")
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=8, max_position_embeddings=32,
        sliding_window=3, query_pre_attn_scalar=8, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, layer_types=["sliding_attention", "full_attention"])
    transformers.Gemma3ForCausalLM(config).save_pretrained(folder)
    return folder


IDS = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(3))


def _logits(model: hf.CausalLM) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _copy(folder: Path, to: Path) -> Path:
    shutil.copytree(folder, to)
    return to


def _edit_weights(folder: Path, edit: object) -> None:
    state = load_file(folder / "model.safetensors")
    edit(state)  # type: ignore[operator]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


def _section(message: str, title: str) -> list[str]:
    """The lines listed under a ``N <title>:`` heading of a CheckpointError."""
    lines = message.splitlines()
    for i, line in enumerate(lines):
        if title in line and line.rstrip().endswith(":"):
            out = []
            for item in lines[i + 1:]:
                if not item.startswith("  "):
                    break
                out.append(item.strip())
            return out
    return []


# ---- refusals name every key, in the file's names ----------------------------------------


def test_every_problem_is_named_in_the_files_names(llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(llama_dir, tmp_path / "bad")

    def edit(state: dict) -> None:
        del state["model.layers.1.mlp.up_proj.weight"]
        del state["model.norm.weight"]
        state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(32, 32)
        state["model.layers.0.self_attn.rotary.weight"] = torch.zeros(2)
        state["model.layers.1.input_layernorm.weight"] = torch.zeros(32, dtype=torch.int32)

    _edit_weights(folder, edit)
    with pytest.raises(CheckpointError, match="nothing was loaded") as info:
        load_lm(folder, tokenizer=False)
    message = str(info.value)
    assert str(folder / "model.safetensors") in message.splitlines()[0]
    assert _section(message, "missing keys") == ["model.layers.1.mlp.up_proj.weight (48, 32)",
                                                 "model.norm.weight (32,)"]
    assert _section(message, "unexpected keys") == ["model.layers.0.self_attn.rotary.weight (2,)"]
    assert _section(message, "mis-shaped keys") == [
        "model.layers.0.self_attn.k_proj.weight: model model.layers.0.self_attn.k_proj.weight "
        "expects (16, 32), found (32, 32)"]
    assert _section(message, "unsupported dtypes")[0].startswith(
        "model.layers.1.input_layernorm.weight: dtype I32")


def test_base_model_layout_and_its_missing_keys(llama_dir: Path, tmp_path: Path) -> None:
    """A file written by LlamaModel (no ``model.`` prefix, no head) with a tied config."""
    folder = _copy(llama_dir, tmp_path / "base")
    state = load_file(llama_dir / "model.safetensors")
    base = {k.removeprefix("model."): v for k, v in state.items() if k != "lm_head.weight"}
    save_file(base, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    model, _ = load_lm(folder, tokenizer=False)
    assert model.lm_head.weight is model.tok_emb.weight
    torch.testing.assert_close(model.tok_emb.weight, state["model.embed_tokens.weight"])
    del base["layers.0.mlp.gate_proj.weight"]
    save_file(base, folder / "model.safetensors")
    with pytest.raises(CheckpointError) as info:
        load_lm(folder, tokenizer=False)
    assert _section(str(info.value), "missing keys") == [
        "layers.0.mlp.gate_proj.weight (48, 32) (model: model.layers.0.mlp.gate_proj.weight)"]


def test_untied_config_needs_the_head(llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(llama_dir, tmp_path / "nohead")
    _edit_weights(folder, lambda s: s.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"missing keys.*\n  lm_head\.weight \(61, 32\)"):
        load_lm(folder, tokenizer=False)


def test_unknown_model_type_names_the_supported_ones(llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(llama_dir, tmp_path / "bloom")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "bloom"}))
    with pytest.raises(ValueError, match="model_type 'bloom' is not a causal LM handformer "
                                         "reads; supported: gpt2, llama, mistral, qwen2, "
                                         "qwen3, gemma2, gemma3_text, gemma3, "
                                         "handformer-causal-lm"):
        load_lm(folder)
    assert set(supported_model_types()) == {*FAMILIES, "handformer-causal-lm"}
    assert not is_causal_source(folder) and is_causal_source(llama_dir)


def test_nowhere_says_no_hub_and_how_to_save_a_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="never a model hub.*save_pretrained"):
        load_lm(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match="no checkpoint folder at meta-llama/Llama-3"):
        load_lm("meta-llama/Llama-3")


def test_options_are_checked(llama_dir: Path) -> None:
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype, got torch.int8"):
        load_lm(llama_dir, dtype=torch.int8)
    with pytest.raises(TypeError, match="tokenizer must be True or False, got 'no'"):
        load_lm(llama_dir, tokenizer="no")
    with pytest.raises(TypeError, match="attention must be an attention kind"):
        load_lm(llama_dir, attention="local")
    with pytest.raises(ValueError, match="device='tpu7' is not a torch device"):
        load_lm(llama_dir, device="tpu7")


# ---- layouts: shards, dtypes, multimodal files ---------------------------------------------


def test_sharded_checkpoint_loads_like_one_file(llama_dir: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM.from_pretrained(llama_dir)
    sharded = tmp_path / "sharded"
    ref.save_pretrained(sharded, max_shard_size="20KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (
        sharded / "model.safetensors").exists()
    one, _ = load_lm(llama_dir, tokenizer=False)
    many, _ = load_lm(sharded, tokenizer=False)
    torch.testing.assert_close(_logits(many), _logits(one), atol=0, rtol=0)

    # an index that disagrees with its shards is named, key by key
    key = "model.layers.0.mlp.up_proj.weight"
    shards = sorted(set(index["weight_map"].values()))
    home = index["weight_map"][key]
    index["weight_map"][key] = next(s for s in shards if s != home)
    index["weight_map"]["model.extra.weight"] = shards[0]
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="does not match its shards; nothing was loaded"
                       ) as info:
        load_lm(sharded, tokenizer=False)
    assert _section(str(info.value), "keys not where the index says") == [
        f"model.extra.weight (index: {shards[0]}, found in no shard)",
        f"{key} (index: {index['weight_map'][key]}, found in {home})"]
    index["weight_map"].pop("model.extra.weight")
    index["weight_map"][key] = "model-99-of-99.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="lists shard model-99-of-99.safetensors"):
        load_lm(sharded, tokenizer=False)
    index["weight_map"][key] = "../model.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="is not a file name in"):
        load_lm(sharded, tokenizer=False)


def test_bfloat16_file_and_dtypes(llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(llama_dir, tmp_path / "bf16")
    state = load_file(llama_dir / "model.safetensors")
    save_file({k: v.bfloat16() for k, v in state.items()}, folder / "model.safetensors")
    model, _ = load_lm(folder, tokenizer=False)  # default: float32
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    torch.testing.assert_close(model.tok_emb.weight,
                               state["model.embed_tokens.weight"].bfloat16().float())
    half, _ = load_lm(folder, dtype=torch.bfloat16, tokenizer=False)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}


def test_gemma3_multimodal_layout_loads_its_text_part(gemma3_dir: Path, tmp_path: Path) -> None:
    """A ``gemma3`` (vision + text) file: the text model under ``model.language_model.`` (or
    the older ``language_model.model.``), the vision tower skipped."""
    text, _ = load_lm(gemma3_dir, tokenizer=False)
    state = load_file(gemma3_dir / "model.safetensors")
    config = json.loads((gemma3_dir / "config.json").read_text())
    for body, head in (("model.language_model.", "lm_head.weight"),
                       ("language_model.model.", "language_model.lm_head.weight")):
        folder = tmp_path / body.replace(".", "_")
        folder.mkdir()
        renamed = {body + k.removeprefix("model."): v for k, v in state.items()}
        renamed["model.vision_tower.patch.weight" if body.startswith("model.")
                else "vision_tower.patch.weight"] = torch.zeros(3, 3)
        renamed[head] = state["model.embed_tokens.weight"].clone()  # a tied head stored too
        save_file(renamed, folder / "model.safetensors")
        (folder / "config.json").write_text(json.dumps(
            {"model_type": "gemma3", "text_config": {**config, "model_type": "gemma3_text"},
             "vision_config": {"model_type": "siglip_vision_model"}}))
        with pytest.raises(CheckpointError, match=f"duplicated keys:\n  .*embed_tokens.weight "
                                                  f"and {head} both load"):
            load_lm(folder, tokenizer=False)
        del renamed[head]
        save_file(renamed, folder / "model.safetensors")
        model, _ = load_lm(folder, tokenizer=False)
        torch.testing.assert_close(_logits(model), _logits(text), atol=0, rtol=0)


def test_build_causal_lm_from_tensors_in_memory(llama_dir: Path) -> None:
    """What the GGUF path does: a config dict and a dict of tensors."""
    config = json.loads((llama_dir / "config.json").read_text())
    state = load_file(llama_dir / "model.safetensors")
    model = build_causal_lm(config, state, source="memory")
    ref, _ = load_lm(llama_dir, tokenizer=False)
    torch.testing.assert_close(_logits(model), _logits(ref), atol=0, rtol=0)
    assert model.tok_emb.weight.data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    state.pop("model.norm.weight")
    with pytest.raises(CheckpointError, match=r"^memory: .*nothing was loaded"):
        build_causal_lm(config, state, source="memory")


def test_loaded_projections_are_packed_with_the_files_values(llama_dir: Path,
                                                             gemma3_dir: Path) -> None:
    """load_lm installs the file's tensors, then stores q/k/v and gate/up back to back (as a
    constructed model has them): one product each in a decoding step, the same values."""
    from handformer.packing import packed_linear

    for folder, prefix in ((llama_dir, "model"), (gemma3_dir, "model")):
        model, _ = load_lm(folder, tokenizer=False)
        state = load_file(folder / "model.safetensors")
        for i, layer in enumerate(model.blocks):
            attn, ff = layer.attn, layer.mlp
            qkv = packed_linear(attn.q_proj, attn.k_proj, attn.v_proj)
            gate_up = packed_linear(ff.gate_proj, ff.up_proj)
            assert qkv is not None and gate_up is not None, (folder.name, i)
            names = [f"{prefix}.layers.{i}.self_attn.{n}_proj.weight" for n in "qkv"]
            assert torch.equal(qkv[0], torch.cat([state[n] for n in names]))
            names = [f"{prefix}.layers.{i}.mlp.{n}_proj.weight" for n in ("gate", "up")]
            assert torch.equal(gate_up[0], torch.cat([state[n] for n in names]))


def test_attention_swaps_every_layer(llama_dir: Path) -> None:
    from handformer.attention.local import LocalAttention

    model, _ = load_lm(llama_dir, tokenizer=False, attention=LocalAttention(3))
    kinds = [layer.attn.attention for layer in model.blocks]
    assert all(isinstance(k, LocalAttention) for k in kinds)
    assert len({id(k) for k in kinds}) == len(kinds)  # one each
    full, _ = load_lm(llama_dir, tokenizer=False)
    for a, b in zip(model.parameters(), full.parameters(), strict=True):
        assert torch.equal(a, b)
    assert not torch.allclose(_logits(model), _logits(full))


# ---- config refusals: one line naming the field and its value -------------------------------


def _hf(model_type: str, **fields: object) -> dict:
    base = dict(model_type=model_type, vocab_size=V, hidden_size=32, intermediate_size=48,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=32)
    return {**base, **fields}


@pytest.mark.parametrize("model_type, fields, message", [
    ("llama", {"num_key_value_heads": 3},
     "llama config field num_key_value_heads=3: must divide num_attention_heads=4"),
    ("qwen3", {"layer_types": ["full_attention"], "use_sliding_window": True},
     "qwen3 config field layer_types=['full_attention']: must list one type per layer: "
     "num_hidden_layers=2, found 1"),
    ("gemma2", {"layer_types": ["full_attention", "chunked_attention"]},
     "unknown layer types ['chunked_attention']"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
     "llama config field rope_parameters.rope_type='yarn': RoPE type not supported; "
     "supported: ['default', 'linear', 'llama3']"),
    ("mistral", {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
     "mistral config field rope_scaling.rope_type='dynamic'"),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}},
     "llama config field rope_parameters.low_freq_factor=None: RoPE type 'llama3' needs a "
     "positive number here"),
    ("qwen2", {"hidden_act": "gelu_fast"},
     "qwen2 config field hidden_act='gelu_fast': activation not supported"),
    ("gemma3_text", {"hidden_activation": "relu6"},
     "gemma3_text config field hidden_activation='relu6'"),
    ("mistral", {"sliding_window": 0}, "mistral config field sliding_window=0: must be a "
                                       "positive integer"),
    ("llama", {"head_dim": 7}, "llama config field head_dim=7: must be an even integer"),
    ("gemma2", {"use_bidirectional_attention": True},
     "gemma2 config field use_bidirectional_attention=True: only causal"),
    ("gemma3_text", {"rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}},
     "rope_parameters.sliding_attention.rope_type='linear': sliding layers run unscaled"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                   "partial_rotary_factor": 0.5}},
     "rope_parameters.partial_rotary_factor=0.5: partial rotary embeddings are not "
     "supported"),
    ("gemma3", {"text_config": None}, "gemma3 config field text_config=None: must be a JSON "
                                      "object"),
])
def test_config_refusals(model_type: str, fields: dict, message: str) -> None:
    with pytest.raises(ConfigFieldError) as info:
        family_for(model_type).config_from_hf(_hf(model_type, **fields))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_config_readings() -> None:
    """Fields read as transformers reads them (defaults where a file leaves them out)."""
    qwen = family_for("qwen2").config_from_hf(
        _hf("qwen2", sliding_window=131072, use_sliding_window=False))
    assert qwen.layer_types is None and qwen.window_size is None  # the window is off
    mistral = family_for("mistral").config_from_hf(_hf("mistral", sliding_window=4096))
    assert mistral.layer_types is None  # a window past the context is full attention
    mistral = family_for("mistral").config_from_hf(_hf("mistral", sliding_window=5))
    assert mistral.layer_types == ["local", "local"] and mistral.window_size == 9
    gemma = family_for("gemma3").config_from_hf(
        {"model_type": "gemma3", "tie_word_embeddings": True,
         "text_config": {k: v for k, v in _hf("gemma3_text", num_hidden_layers=7,
                                              sliding_window=4).items()
                         if k != "model_type"}})
    assert gemma.layer_types == ["local"] * 5 + ["full", "local"]  # 5 : 1 by default
    assert (gemma.rotary_base, gemma.rotary_local_base) == (1e6, 1e4)
    assert gemma.head_dim == 256 and gemma.attn_scale == 256 ** -0.5  # class defaults
    assert gemma.embed_scale == 32 ** 0.5 and gemma.tie_weights
    old = family_for("llama").config_from_hf(_hf("llama", rope_theta=5e5, rope_scaling={
        "type": "linear", "factor": 4.0}))
    assert old.rotary_base == 5e5
    assert old.rotary_scaling == {"rope_type": "linear", "factor": 4.0}


# ---- GPT-2 and handformer runs through the same entry point -----------------------------


def test_gpt2_and_train_runs_load_through_load_lm(tmp_path: Path) -> None:
    config = transformers.GPT2Config(vocab_size=V, n_positions=16, n_embd=16, n_layer=2,
                                     n_head=2)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    a, _ = load_lm(tmp_path / "gpt2", tokenizer=False)
    b, _ = load_gpt2(tmp_path / "gpt2", tokenizer=False)
    torch.testing.assert_close(_logits(a), _logits(b), atol=0, rtol=0)
    a.save_pretrained(tmp_path / "ours")
    c, tok = load_lm(tmp_path / "ours", tokenizer=False)
    torch.testing.assert_close(_logits(c), _logits(a), atol=0, rtol=0)
    with pytest.warns(UserWarning, match="has no tokenizer.*load_lm returns the model with "
                                         "tokenizer None"):
        assert load_lm(tmp_path / "ours")[1] is None


def test_attention_swap_keeps_the_models_soft_cap(tmp_path: Path) -> None:
    from handformer.attention.kinds import FullAttention

    config = transformers.Gemma2Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
        sliding_window=64, attn_logit_softcapping=1.5, initializer_range=0.5)
    torch.manual_seed(0)
    transformers.Gemma2ForCausalLM(config).save_pretrained(tmp_path)
    loaded, _ = load_lm(tmp_path, tokenizer=False)  # window >= context: full attention
    swapped, _ = load_lm(tmp_path, tokenizer=False, attention=FullAttention())
    assert [layer.attn.attention.softcap for layer in swapped.blocks] == [1.5, 1.5]
    torch.testing.assert_close(_logits(swapped), _logits(loaded), atol=1e-6, rtol=0)


def test_tokenizer_false_is_quiet(llama_dir: Path) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, tok = load_lm(llama_dir, tokenizer=False)
    assert tok is None and not model.training
    with pytest.warns(UserWarning, match="has no tokenizer"):
        load_lm(llama_dir)  # the folder has none: said once
