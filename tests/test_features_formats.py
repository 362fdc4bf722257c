"""load_dictionary on files written here in each published layout (the real key names,
orientations, dtypes and config fields: SAELens v5 and v6, Gemma Scope 1 and 2, sparsify,
circuit-tracer sets, handformer's own), each checked against that format's own formula in
float64 written out here; round trips through save_dictionary; and the refusals of damaged or
unsupported files, each naming the file, field or tensor. No SAELens, sparsify or
circuit-tracer package is used."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from handformer.features import (
    DictionaryFileError,
    SparseAutoencoder,
    Transcoder,
    attach,
    load_dictionary,
    save_dictionary,
)

D, F, OUT, K = 12, 40, 10, 5
G = torch.Generator().manual_seed(0)


def rand(*shape, dtype=torch.float32, scale=0.5):
    return (torch.randn(shape, generator=G, dtype=torch.float64) * scale).to(dtype)


def x_batch(n=6):
    return rand(n, D, dtype=torch.float64, scale=1.0)


def relu(t):
    return t.clamp(min=0)


def jump(pre, threshold):
    return pre * (pre > threshold)


def topk(pre, k):
    """Keep the k largest (ties: lowest index), then ReLU (SAELens' and sparsify's order)."""
    out = torch.zeros_like(pre)
    for n in range(pre.shape[0]):
        keep = sorted(range(pre.shape[1]), key=lambda f: (-pre[n, f].item(), f))[:k]
        out[n, keep] = relu(pre[n, keep])
    return out


def f64(t):
    return t.to(torch.float64)


def check(d, x, expected, atol=1e-5):
    torch.testing.assert_close(f64(d(x.to(d.dtype))), expected, rtol=1e-4, atol=atol)


# -- SAELens --------------------------------------------------------------------------------

def write_saelens(folder: Path, cfg: dict, tensors: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "cfg.json").write_text(json.dumps(cfg))
    save_file(tensors, str(folder / "sae_weights.safetensors"))
    return folder


def saelens_tensors(d_out=D, skip=False, threshold=False):
    t = {"W_enc": rand(D, F), "b_enc": rand(F), "W_dec": rand(F, d_out), "b_dec": rand(d_out)}
    if threshold:
        t["threshold"] = rand(F).abs()
    if skip:
        t["W_skip"] = rand(d_out, D)  # SAELens: (d_out, d_in), used as x @ W_skip.T
    return t


V5 = {"d_in": D, "d_sae": F, "dtype": "float32", "model_name": "tiny",
      "hook_point": "blocks.1.hook_resid_post", "hook_point_layer": 1,
      "hook_point_head_index": None, "activation_fn_str": "relu",
      "apply_b_dec_to_input": True, "normalize_activations": False, "context_size": 128}


def v6(architecture, **extra):
    return {"architecture": architecture, "d_in": D, "d_sae": F, "dtype": "float32",
            "device": "cpu", "apply_b_dec_to_input": False, "normalize_activations": "none",
            "reshape_activations": "none",
            "metadata": {"model_name": "tiny", "hook_name": "blocks.1.hook_resid_post",
                         "hook_head_index": None, "sae_lens_version": "6.5.0"}, **extra}


def test_saelens_v5_standard_relu(tmp_path):
    t = saelens_tensors()
    sae = load_dictionary(write_saelens(tmp_path / "sae", V5, t))
    assert isinstance(sae, SparseAutoencoder) and sae.hook_name == "blocks.1.hook_resid_post"
    assert sae.meta["format"] == "saelens-v5" and sae.dtype == torch.float32
    x = x_batch()
    acts = relu((x - f64(t["b_dec"])) @ f64(t["W_enc"]) + f64(t["b_enc"]))
    check(sae, x, acts @ f64(t["W_dec"]) + f64(t["b_dec"]))


def test_saelens_v5_topk_from_activation_fn_kwargs(tmp_path):
    t = saelens_tensors()
    cfg = {**V5, "activation_fn_str": "topk", "activation_fn_kwargs": {"k": K}}
    sae = load_dictionary(write_saelens(tmp_path / "sae", cfg, t))
    assert sae.activation == "topk" and sae.k == K
    x = x_batch()
    acts = topk((x - f64(t["b_dec"])) @ f64(t["W_enc"]) + f64(t["b_enc"]), K)
    check(sae, x, acts @ f64(t["W_dec"]) + f64(t["b_dec"]))


def test_saelens_v6_topk_and_jumprelu(tmp_path):
    t = saelens_tensors()
    sae = load_dictionary(write_saelens(tmp_path / "topk", v6("topk", k=K), t))
    assert (sae.activation, sae.k, sae.meta["format"]) == ("topk", K, "saelens-v6")
    assert sae.hook_name == "blocks.1.hook_resid_post"
    x = x_batch()
    acts = topk(x @ f64(t["W_enc"]) + f64(t["b_enc"]), K)  # apply_b_dec_to_input: false
    check(sae, x, acts @ f64(t["W_dec"]) + f64(t["b_dec"]))
    t = saelens_tensors(threshold=True)
    sae = load_dictionary(write_saelens(tmp_path / "jump", v6("jumprelu"), t))
    acts = jump(x @ f64(t["W_enc"]) + f64(t["b_enc"]), f64(t["threshold"]))
    check(sae, x, acts @ f64(t["W_dec"]) + f64(t["b_dec"]))


def test_saelens_v6_skip_transcoder(tmp_path):
    t = saelens_tensors(d_out=OUT, skip=True, threshold=True)
    cfg = v6("jumprelu_skip_transcoder", d_out=OUT)
    cfg["metadata"].update(hook_name="blocks.1.ln2.hook_normalized",
                           hook_name_out="blocks.1.hook_mlp_out")
    tc = load_dictionary(write_saelens(tmp_path / "tc", cfg, t))
    assert isinstance(tc, Transcoder) and tc.has_skip and tc.d_out == OUT
    assert (tc.hook_name, tc.output_hook_name) == ("blocks.1.ln2.hook_normalized",
                                                   "blocks.1.hook_mlp_out")
    x = x_batch()
    acts = jump(x @ f64(t["W_enc"]) + f64(t["b_enc"]), f64(t["threshold"]))
    check(tc, x, acts @ f64(t["W_dec"]) + f64(t["b_dec"]) + x @ f64(t["W_skip"]).T)


def test_saelens_constant_norm_rescale(tmp_path):
    t = saelens_tensors()
    sae = load_dictionary(write_saelens(
        tmp_path / "sae", {**V5, "normalize_activations": "constant_norm_rescale"}, t))
    x = x_batch() * 7
    s = D ** 0.5 / x.norm(dim=-1, keepdim=True)
    acts = relu((x * s - f64(t["b_dec"])) @ f64(t["W_enc"]) + f64(t["b_enc"]))
    check(sae, x, (acts @ f64(t["W_dec"]) + f64(t["b_dec"])) / s)


@pytest.mark.parametrize(("change", "match"), [
    ({"normalize_activations": "expected_average_only_in"},
     "normalize_activations = 'expected_average_only_in' is not supported"),
    ({"normalize_activations": True},
     "normalize_activations = 'expected_average_only_in' is not supported"),
    ({"normalize_activations": "layer_norm"}, "normalize_activations = 'layer_norm'"),
    ({"architecture": "gated"}, "architecture = 'gated' is not supported"),
    ({"activation_fn_str": "tanh-relu"}, "activation_fn = 'tanh-relu' is not supported"),
    ({"finetuning_scaling_factor": True}, "finetuning_scaling_factor = True"),
    ({"hook_point": "blocks.1.attn.hook_z"}, "hook_name = 'blocks.1.attn.hook_z'"),
    ({"hook_point_head_index": 3}, "hook_head_index = 3"),
    ({"activation_fn_str": "topk"}, "a topk SAE needs an integer k"),
])
def test_saelens_unsupported_fields_are_refused_by_name(tmp_path, change, match):
    folder = write_saelens(tmp_path / "sae", {**V5, **change}, saelens_tensors())
    with pytest.raises(DictionaryFileError, match=match):
        load_dictionary(folder)


# -- Gemma Scope ------------------------------------------------------------------------------

def test_gemma_scope_1_npz(tmp_path):
    folder = tmp_path / "gemma-scope-2b-pt-res" / "layer_3" / "width_16k" / "average_l0_71"
    folder.mkdir(parents=True)
    arrays = {"W_enc": rand(D, F).numpy(), "W_dec": rand(F, D).numpy(),
              "b_enc": rand(F).numpy(), "b_dec": rand(D).numpy(),
              "threshold": rand(F).abs().numpy()}
    np.savez(folder / "params.npz", **arrays)
    sae = load_dictionary(folder)
    assert sae.hook_name == "blocks.3.hook_resid_post" and not sae.apply_b_dec_to_input
    x = x_batch()
    a = {k: torch.from_numpy(v).double() for k, v in arrays.items()}
    acts = jump(x @ a["W_enc"] + a["b_enc"], a["threshold"])
    check(sae, x, acts @ a["W_dec"] + a["b_dec"])


def write_gemma_scope_2(folder: Path, cfg: dict, *, affine=False, dtype=torch.float32):
    folder.mkdir(parents=True)
    d_out = OUT if affine else D
    t = {"w_enc": rand(D, F, dtype=dtype), "w_dec": rand(F, d_out, dtype=dtype),
         "b_enc": rand(F, dtype=dtype), "b_dec": rand(d_out, dtype=dtype),
         "threshold": rand(F, dtype=dtype).abs()}
    if affine:
        t["affine_skip_connection"] = rand(D, d_out, dtype=dtype)  # x @ A
    save_file(t, str(folder / "params.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "examples.safetensors").write_bytes(b"not read")
    return t


def test_gemma_scope_2_sae_and_affine_transcoder(tmp_path):
    cfg = {"hf_hook_point_in": "model.layers.2.output", "width": F, "l0": 20,
           "model_name": "google/gemma-3-270m-pt", "architecture": "jump_relu"}
    t = write_gemma_scope_2(tmp_path / "resid_post" / "layer_2_width_16k_l0_small", cfg)
    sae = load_dictionary(tmp_path / "resid_post" / "layer_2_width_16k_l0_small")
    assert isinstance(sae, SparseAutoencoder) and sae.hook_name == "blocks.2.hook_resid_post"
    x = x_batch()
    a = {k: f64(v) for k, v in t.items()}
    check(sae, x, jump(x @ a["w_enc"] + a["b_enc"], a["threshold"]) @ a["w_dec"] + a["b_dec"])

    cfg = {"hf_hook_point_in": "model.layers.5.pre_feedforward_layernorm.output",
           "hf_hook_point_out": "model.layers.5.post_feedforward_layernorm.output",
           "width": F, "l0": 30, "architecture": "jump_relu"}
    folder = tmp_path / "transcoder_all" / "layer_5_width_16k_l0_big_affine"
    t = write_gemma_scope_2(folder, cfg, affine=True, dtype=torch.bfloat16)
    tc = load_dictionary(folder / "params.safetensors")
    assert isinstance(tc, Transcoder) and tc.has_skip and tc.dtype == torch.bfloat16
    assert (tc.hook_name, tc.output_hook_name) == ("blocks.5.mlp.hook_in",
                                                   "blocks.5.hook_mlp_out")
    a = {k: f64(v) for k, v in t.items()}
    xb = f64(x.to(torch.bfloat16))
    expected = (jump(xb @ a["w_enc"] + a["b_enc"], a["threshold"]) @ a["w_dec"] + a["b_dec"]
                + xb @ a["affine_skip_connection"])
    torch.testing.assert_close(f64(tc(x.to(torch.bfloat16))), expected, rtol=0.05, atol=0.1)


def test_gemma_scope_2_refusals(tmp_path):
    cfg = {"hf_hook_point_in": "model.layers.2.self_attn.o_proj.input"}
    write_gemma_scope_2(tmp_path / "attn", cfg)
    with pytest.raises(DictionaryFileError, match="o_proj.input"):
        load_dictionary(tmp_path / "attn")
    clt = tmp_path / "clt" / "layer_3"
    clt.mkdir(parents=True)
    save_file({"w_enc": rand(D, F), "w_dec": rand(F, 4, D), "b_enc": rand(F),
               "b_dec": rand(D), "threshold": rand(F)}, str(clt / "params.safetensors"))
    with pytest.raises(DictionaryFileError, match="cross-layer transcoder"):
        load_dictionary(clt)


# -- sparsify ---------------------------------------------------------------------------------

def test_sparsify_sae_in_bfloat16_and_transcoder_with_skip(tmp_path):
    folder = tmp_path / "sae-run" / "layers.1"
    folder.mkdir(parents=True)
    bf = torch.bfloat16
    t = {"encoder.weight": rand(F, D, dtype=bf), "encoder.bias": rand(F, dtype=bf),
         "W_dec": rand(F, D, dtype=bf), "b_dec": rand(D, dtype=bf)}
    save_file(t, str(folder / "sae.safetensors"))
    (folder / "cfg.json").write_text(json.dumps({
        "activation": "topk", "expansion_factor": 32, "normalize_decoder": True,
        "num_latents": F, "k": K, "multi_topk": False, "skip_connection": False,
        "transcode": False, "d_in": D}))
    sae = load_dictionary(folder)
    assert sae.dtype == bf and sae.hook_name == "blocks.1.hook_resid_post"
    assert sae.W_enc.shape == (D, F) and sae.W_enc.data_ptr() == sae.W_enc.T.data_ptr()
    a = {k: f64(v) for k, v in t.items()}
    x = f64(x_batch().to(bf))
    acts = topk(relu((x - a["b_dec"]) @ a["encoder.weight"].T + a["encoder.bias"]), K)
    torch.testing.assert_close(f64(sae(x.to(bf))), acts @ a["W_dec"] + a["b_dec"],
                               rtol=0.05, atol=0.1)

    folder = tmp_path / "sae-run" / "layers.2.mlp"
    folder.mkdir(parents=True)
    t = {"encoder.weight": rand(F, D), "encoder.bias": rand(F), "W_dec": rand(F, D),
         "b_dec": rand(D), "W_skip": rand(D, D)}
    save_file(t, str(folder / "sae.safetensors"))
    (folder / "cfg.json").write_text(json.dumps({
        "activation": "topk", "num_latents": F, "k": K, "skip_connection": True,
        "transcode": True, "d_in": D}))
    tc = load_dictionary(folder)
    assert isinstance(tc, Transcoder)
    assert (tc.hook_name, tc.output_hook_name) == ("blocks.2.mlp.hook_in",
                                                   "blocks.2.mlp.hook_out")
    a = {k: f64(v) for k, v in t.items()}
    x = x_batch()
    acts = topk(relu(x @ a["encoder.weight"].T + a["encoder.bias"]), K)  # no b_dec shift
    check(tc, x, acts @ a["W_dec"] + a["b_dec"] + x @ a["W_skip"].T)
    (folder / "cfg.json").write_text(json.dumps({"activation": "groupmax", "d_in": D,
                                                 "num_latents": F, "k": K}))
    with pytest.raises(DictionaryFileError, match="activation = 'groupmax'"):
        load_dictionary(folder)


# -- circuit-tracer ---------------------------------------------------------------------------

def write_ct_safetensors(path: Path, *, old_decoder=False):
    t = {"W_enc": rand(F, D), "b_enc": rand(F), "b_dec": rand(D), "W_skip": rand(D, D),
         "W_dec": rand(D, F) if old_decoder else rand(F, D)}
    save_file(t, str(path))
    return t


def test_circuit_tracer_sets(tmp_path):
    """The older config form (dicts, Gemma Scope npz files) and the newer one (hf:// paths
    to circuit-tracer safetensors files, read from the config's folder)."""
    for layer in range(2):
        folder = tmp_path / "gs" / f"layer_{layer}"
        folder.mkdir(parents=True)
        np.savez(folder / "params.npz", W_enc=rand(D, F).numpy(), W_dec=rand(F, D).numpy(),
                 b_enc=rand(F).numpy(), b_dec=rand(D).numpy(), threshold=rand(F).numpy())
    (tmp_path / "gs" / "config.yaml").write_text(
        'model_name: "tiny"\nfeature_input_hook: "ln2.hook_normalized"\n'
        "feature_output_hook: 'hook_mlp_out'\ntranscoders:\n"
        + "".join(f'  - id: "t{i}"\n    layer: {i}\n    filepath: "layer_{i}/params.npz"\n'
                  for i in (1, 0)))
    tcs = load_dictionary(tmp_path / "gs")
    assert [t.meta["layer"] for t in tcs] == [0, 1]
    assert all(isinstance(t, Transcoder) and t.activation == "jumprelu" for t in tcs)
    assert (tcs[1].hook_name, tcs[1].output_hook_name) == ("blocks.1.mlp.hook_in",
                                                           "blocks.1.hook_mlp_out")

    folder = tmp_path / "ct"
    folder.mkdir()
    t0 = write_ct_safetensors(folder / "layer_0.safetensors")
    t1 = write_ct_safetensors(folder / "layer_1.safetensors", old_decoder=True)
    (folder / "config.yaml").write_text(
        "model_kind: transcoder_set\nmodel_name: tiny\nfeature_input_hook: hook_resid_mid\n"
        "feature_output_hook: mlp.hook_out\ntranscoders:\n"
        "  - hf://someone/skip-transcoders/layer_0.safetensors?revision=new\n"
        "  - layer_1.safetensors\n")
    tcs = load_dictionary(folder / "config.yaml")
    assert (tcs[0].hook_name, tcs[0].output_hook_name) == ("blocks.0.hook_resid_mid",
                                                           "blocks.0.mlp.hook_out")
    x = x_batch()
    for tc, t, old in ((tcs[0], t0, False), (tcs[1], t1, True)):
        a = {k: f64(v) for k, v in t.items()}
        W_dec = a["W_dec"].T if old else a["W_dec"]
        acts = relu(x @ a["W_enc"].T + a["b_enc"])
        check(tc, x, acts @ W_dec + a["b_dec"] + x @ a["W_skip"].T)


@pytest.mark.parametrize(("yaml_text", "match"), [
    ("model_kind: cross_layer_transcoder\ntranscoders: [a.safetensors]\n",
     "model_kind = 'cross_layer_transcoder' is not supported"),
    ("feature_input_hook: hook_resid_mid\nfeature_output_hook: hook_mlp_out\n"
     "transcoders: [hf://a/b/missing.safetensors]\n", "never downloads"),
    ("feature_input_hook: hook_resid_mid\nfeature_output_hook: hook_mlp_out\n"
     "transcoders: [../outside.safetensors]\n", "outside the config's folder"),
    ("feature_input_hook: attn.hook_z\nfeature_output_hook: hook_mlp_out\n"
     "transcoders: [layer_0.safetensors]\n", "feature_input_hook = 'attn.hook_z'"),
    ("transcoders: !!python/object/apply:os.system ['true']\n", "not valid YAML"),
])
def test_circuit_tracer_refusals(tmp_path, yaml_text, match):
    folder = tmp_path / "set"
    folder.mkdir()
    write_ct_safetensors(folder / "layer_0.safetensors")
    write_ct_safetensors(tmp_path / "outside.safetensors")
    (folder / "config.yaml").write_text(yaml_text)
    with pytest.raises(DictionaryFileError, match=match):
        load_dictionary(folder)


# -- handformer's own, round trips ------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trips(tmp_path, dtype):
    made = [SparseAutoencoder(D, F, activation="topk", k=K, dtype=dtype,
                              hook_name="blocks.0.hook_resid_post"),
            SparseAutoencoder(D, F, activation="jumprelu", apply_b_dec_to_input=False,
                              normalize_activations="constant_norm_rescale", input_scale=2.0,
                              dtype=dtype),
            Transcoder(D, F, OUT, activation="relu", skip=True, dtype=dtype,
                       hook_name="blocks.0.mlp.hook_in", output_hook_name="blocks.0.hook_mlp_out")]
    for i, d in enumerate(made):
        with torch.no_grad():
            for p in d.parameters():
                p.copy_(rand(*p.shape, dtype=dtype))
        path = save_dictionary(d, tmp_path / f"d{i}")
        assert path.name == "dictionary.safetensors" and not list(tmp_path.glob(f"d{i}/*.tmp*"))
        back = load_dictionary(tmp_path / f"d{i}")
        assert type(back) is type(d) and back.config() == d.config()
        for name, p in d.named_parameters():
            assert torch.equal(getattr(back, name), p), name
        x = x_batch().to(dtype)
        assert torch.equal(back(x), d(x))
    # a foreign format saved again in handformer's
    t = saelens_tensors()
    sae = load_dictionary(write_saelens(tmp_path / "saelens", V5, t))
    again = load_dictionary(save_dictionary(sae, tmp_path / "again.safetensors"))
    assert torch.equal(again.W_enc, t["W_enc"]) and again.hook_name == sae.hook_name


def test_a_loaded_set_splices_into_a_model(tmp_path):
    import handformer as hf

    torch.manual_seed(0)
    model = hf.CausalLM(hf.CausalLMConfig(vocab_size=17, max_len=16, d_model=D, num_heads=2,
                                          num_layers=2, d_ff=24, norm="rms",
                                          norm_first=True)).eval()
    folder = tmp_path / "ct"
    folder.mkdir()
    for layer in range(2):
        write_ct_safetensors(folder / f"layer_{layer}.safetensors")
    (folder / "config.yaml").write_text(
        "feature_input_hook: ln2.hook_normalized\nfeature_output_hook: hook_mlp_out\n"
        "transcoders: [layer_0.safetensors, layer_1.safetensors]\n")
    ids = torch.randint(0, 17, (1, 7))
    base = model(ids).logits
    with attach(model, load_dictionary(folder)):
        assert (model(ids).logits - base).abs().max() <= 1e-6
    wide = SparseAutoencoder(D + 4, F, hook_name="blocks.0.hook_resid_post")
    with pytest.raises(ValueError, match=r"d_in = 16 does not fit 'blocks.0.hook_resid_post' "
                                         r"of this model \(width 12\)"):
        attach(model, load_dictionary(save_dictionary(wide, tmp_path / "wide")))


# -- damaged files ----------------------------------------------------------------------------

def test_damaged_files_are_refused_by_name(tmp_path):
    good = saelens_tensors()
    folder = write_saelens(tmp_path / "shape", V5, {**good, "W_dec": rand(F - 1, D)})
    with pytest.raises(DictionaryFileError, match=r"tensor 'W_dec' has shape \(39, 12\), "
                                                  r"expected \(40, 12\)"):
        load_dictionary(folder)
    nan = good["b_enc"].clone()
    nan[7] = float("nan")
    folder = write_saelens(tmp_path / "nan", V5, {**good, "b_enc": nan})
    with pytest.raises(DictionaryFileError, match=r"tensor 'b_enc' holds NaN or infinity "
                                                  r"\(first at flat index 7\)"):
        load_dictionary(folder)
    inf = good["W_enc"].clone()
    inf[5, 3] = -float("inf")
    folder = write_saelens(tmp_path / "inf", V5, {**good, "W_enc": inf})
    with pytest.raises(DictionaryFileError, match=r"tensor 'W_enc' holds NaN or infinity "
                                                  rf"\(first at flat index {5 * F + 3}\)"):
        load_dictionary(folder)
    folder = write_saelens(tmp_path / "missing", V5,
                           {k: v for k, v in good.items() if k != "b_dec"})
    with pytest.raises(DictionaryFileError, match="missing tensor 'b_dec'"):
        load_dictionary(folder)
    folder = write_saelens(tmp_path / "cut", V5, good)
    weights = folder / "sae_weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(DictionaryFileError, match="truncated or corrupt"):
        load_dictionary(folder)
    folder = write_saelens(tmp_path / "huge", {**V5, "d_sae": 2**40}, good)
    with pytest.raises(DictionaryFileError, match=r"d_sae = 1099511627776 is out of range"):
        load_dictionary(folder)
    ints = {**good, "b_enc": torch.zeros(F, dtype=torch.int32)}
    folder = write_saelens(tmp_path / "ints", V5, ints)
    with pytest.raises(DictionaryFileError, match="tensor 'b_enc' has dtype I32"):
        load_dictionary(folder)


def test_a_huge_declared_size_is_refused_before_allocating(tmp_path):
    """A safetensors header and an npz array header that claim far more data than the file
    holds: refused from the headers (nothing of that size is allocated)."""
    header = json.dumps({"W_enc": {"dtype": "F32", "shape": [2**20, 2**20],
                                   "data_offsets": [0, 2**42]}}).encode()
    folder = tmp_path / "st"
    folder.mkdir()
    (folder / "params.safetensors").write_bytes(len(header).to_bytes(8, "little") + header
                                                + b"\0" * 64)
    with pytest.raises(DictionaryFileError, match="truncated or corrupt"):
        load_dictionary(folder)
    folder = tmp_path / "npz"
    folder.mkdir()
    np.savez(folder / "params.npz", W_enc=np.zeros((D, F), np.float32))
    import zipfile

    with zipfile.ZipFile(folder / "params.npz", "w") as z:  # a header claiming 10^12 floats
        magic = b"\x93NUMPY\x01\x00"
        text = "{'descr': '<f4', 'fortran_order': False, 'shape': (1000000, 1000000), }"
        text = text.ljust(118) + "\n"
        z.writestr("W_enc.npy", magic + len(text).to_bytes(2, "little") + text.encode()
                   + b"\0" * 64)
    with pytest.raises(DictionaryFileError, match=r"declares shape \(1000000, 1000000\)"):
        load_dictionary(folder)


def test_unknown_layouts_and_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_dictionary(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="not a dictionary layout handformer knows"):
        load_dictionary(tmp_path / "empty")
    save_file({"x": rand(3)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(DictionaryFileError, match="not a dictionary saved by handformer"):
        load_dictionary(tmp_path / "plain.safetensors")
