"""One loader per published layout, behind :func:`load_dictionary`.

Each reads a local folder or file (never a hub), checks every size and shape from the headers
before reading data, and turns the format's key names and orientations into handformer's
(``W_enc (d_in, d_sae)``, ``W_dec (d_sae, d_out)``; a transposed file tensor becomes a
transposed view, not a copy). ``docs/features.md`` has the table of keys and transposes.

Hook names are mapped to handformer's: SAELens and circuit-tracer use TransformerLens' names,
which are handformer's (``blocks.6.hook_resid_post``; ``ln2.hook_normalized``, the MLP's input,
is spelled ``blocks.6.mlp.hook_in``); Gemma Scope 2 names Hugging Face modules
(``model.layers.6.output``); sparsify names the module it read (``layers.6``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from torch import Tensor

from handformer.features.build import build_dictionary
from handformer.features.dictionary import Dictionary
from handformer.features.files import (
    DictionaryFileError,
    check_shapes,
    check_sizes,
    npz_shapes,
    read_json,
    read_npz,
    read_safetensors,
    safetensors_shapes,
)

__all__ = ["load_saelens", "load_gemma_scope_1", "load_gemma_scope_2", "load_sparsify",
           "read_weights", "gemma_scope_2_hook"]


def read_weights(path: Path, layout: dict[str, tuple[str, tuple[int, ...], bool]],
                 optional: tuple[str, ...] = ()) -> dict[str, Tensor]:
    """Read a safetensors or npz file given ``{name: (file key, file shape, transposed)}``:
    shapes checked from the header first, then read, then transposed (as views) into
    handformer's orientation. Keys the layout does not name are not read."""
    shapes = npz_shapes(path) if path.suffix == ".npz" else None
    raw = None
    if shapes is None:
        shapes, raw = safetensors_shapes(path)
    by_key = {key: shape for key, shape, _ in layout.values()}
    check_shapes(path, shapes, by_key, optional=tuple(layout[o][0] for o in optional
                                                     if o in layout))
    keys = [key for key, _, _ in layout.values() if key in shapes]
    data = read_npz(path, keys) if raw is None else read_safetensors(path, raw, keys)
    return {name: (data[key].T if transposed else data[key])
            for name, (key, _, transposed) in layout.items() if key in data}


def _int(path: Path, cfg: dict[str, Any], field: str) -> int:
    value = cfg.get(field)
    if isinstance(value, bool) or not isinstance(value, int):
        raise DictionaryFileError(f"{path}: field {field!r} must be an integer, got {value!r}")
    return value


def _refuse(path: Path, field: str, value: Any, why: str) -> DictionaryFileError:
    return DictionaryFileError(f"{path}: {field} = {value!r} is not supported ({why})")


# -- SAELens ----------------------------------------------------------------------------------

_SAELENS_ARCH = {  # architecture -> (kind, activation or None: from activation_fn, skip)
    "standard": ("sae", None, False), "jumprelu": ("sae", "jumprelu", False),
    "topk": ("sae", "topk", False), "transcoder": ("transcoder", "relu", False),
    "skip_transcoder": ("transcoder", "relu", True),
    "jumprelu_transcoder": ("transcoder", "jumprelu", False),
    "jumprelu_skip_transcoder": ("transcoder", "jumprelu", True),
}


def load_saelens(folder: Path) -> Dictionary:
    """SAELens: ``cfg.json`` + ``sae_weights.safetensors`` (v5 flat or v6 ``metadata`` cfg).

    Raises:
        DictionaryFileError: for an unsupported field (named), a missing key or a bad shape.
    """
    cfg_path = folder / "cfg.json"
    cfg = read_json(cfg_path)
    meta = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
    version = "v6" if meta or str(cfg.get("sae_lens_version", "")).startswith("6") else "v5"

    def field(name: str, *old: str, default: Any = None) -> Any:
        for key in (name, *old):
            if key in cfg:
                return cfg[key]
            if key in meta:
                return meta[key]
        return default

    arch = cfg.get("architecture", "standard")
    if arch not in _SAELENS_ARCH:
        raise _refuse(cfg_path, "architecture", arch, f"handformer reads "
                      f"{sorted(_SAELENS_ARCH)}; gated and batch-top-k training checkpoints "
                      "are not")
    kind, activation, skip = _SAELENS_ARCH[arch]
    k = None
    if activation is None:  # standard: the activation comes from activation_fn
        fn = field("activation_fn", "activation_fn_str", default="relu")
        if fn not in ("relu", "topk"):
            raise _refuse(cfg_path, "activation_fn", fn, "handformer reads relu and topk")
        activation = fn
    if activation == "topk":
        kwargs = field("activation_fn_kwargs", default={}) or {}
        k = cfg.get("k", kwargs.get("k") if isinstance(kwargs, dict) else None)
        if isinstance(k, bool) or not isinstance(k, int):
            raise DictionaryFileError(f"{cfg_path}: a topk SAE needs an integer k "
                                      f"(k or activation_fn_kwargs.k), got {k!r}")
    for name, bad in (("finetuning_scaling_factor", True), ("rescale_acts_by_decoder_norm", True)):
        if cfg.get(name) is bad:
            raise _refuse(cfg_path, name, bad, "its scaling is not part of the weights")
    reshape = cfg.get("reshape_activations", "none")
    hook = field("hook_name", "hook_point")
    if reshape not in ("none", None) or (isinstance(hook, str) and hook.endswith("hook_z")):
        raise _refuse(cfg_path, "reshape_activations" if reshape not in ("none", None)
                      else "hook_name", reshape if reshape not in ("none", None) else hook,
                      "attention-head (hook_z) dictionaries are not supported")
    if field("hook_head_index", "hook_point_head_index") is not None:
        raise _refuse(cfg_path, "hook_head_index", field("hook_head_index",
                                                         "hook_point_head_index"),
                      "per-head dictionaries are not supported")
    norm = cfg.get("normalize_activations", "none")
    norm = {None: "none", False: "none", True: "expected_average_only_in"}.get(norm, norm)
    if norm not in ("none", "constant_norm_rescale"):
        raise _refuse(cfg_path, "normalize_activations", norm, "its scaling factor is not in "
                      "the file (SAELens folds it into the weights when it saves a trained "
                      "SAE); handformer reads none and constant_norm_rescale")
    apply_b_dec = cfg.get("apply_b_dec_to_input", True)
    if not isinstance(apply_b_dec, bool):
        raise DictionaryFileError(f"{cfg_path}: apply_b_dec_to_input must be true or false, "
                                  f"got {apply_b_dec!r}")
    if kind == "transcoder" and apply_b_dec:
        raise _refuse(cfg_path, "apply_b_dec_to_input", True, "a transcoder's b_dec is an "
                      "output-space bias")
    d_in, d_sae = _int(cfg_path, cfg, "d_in"), _int(cfg_path, cfg, "d_sae")
    d_out = _int(cfg_path, cfg, "d_out") if kind == "transcoder" and "d_out" in cfg else d_in
    check_sizes(cfg_path, d_in=d_in, d_sae=d_sae, d_out=d_out)
    weights = folder / "sae_weights.safetensors"
    layout = {"W_enc": ("W_enc", (d_in, d_sae), False), "b_enc": ("b_enc", (d_sae,), False),
              "W_dec": ("W_dec", (d_sae, d_out), False), "b_dec": ("b_dec", (d_out,), False)}
    shapes, _ = safetensors_shapes(weights)
    if activation == "jumprelu":
        log = "log_threshold" in shapes and "threshold" not in shapes
        layout["threshold"] = ("log_threshold" if log else "threshold", (d_sae,), False)
    if skip:
        layout["W_skip"] = ("W_skip", (d_out, d_in), True)  # stored (d_out, d_in): x @ W_skip.T
    if "scaling_factor" in shapes:
        layout["scaling_factor"] = ("scaling_factor", shapes["scaling_factor"], False)
    tensors = read_weights(weights, layout)
    if "scaling_factor" in tensors:
        factor = tensors.pop("scaling_factor")
        if not bool((factor == 1).all()):
            raise _refuse(weights, "scaling_factor", "not all 1", "a fine-tuning scaling "
                          "factor is not supported")
    if activation == "jumprelu" and layout["threshold"][0] == "log_threshold":
        tensors["threshold"] = tensors["threshold"].exp()
    return build_dictionary(
        weights, tensors, kind=kind, activation=activation, k=k,
        apply_b_dec_to_input=apply_b_dec if kind == "sae" else False,
        normalize_activations=norm, hook_name=hook,
        output_hook_name=field("hook_name_out") if kind == "transcoder" else None,
        meta={"format": f"saelens-{version}", "path": str(folder),
              "model_name": field("model_name"), "architecture": arch})


# -- Gemma Scope ------------------------------------------------------------------------------

def _gemma_scope_1_hook(path: Path) -> tuple[str, str | None, str | None]:
    """``(kind, hook, output hook)`` from a Gemma Scope 1 path
    (``gemma-scope-2b-pt-res/layer_20/width_16k/average_l0_71/params.npz``)."""
    text = path.as_posix()
    layer = re.search(r"layer_(\d+)", text)
    if "transcoder" in text:
        if layer:
            L = layer.group(1)
            return "transcoder", f"blocks.{L}.mlp.hook_in", f"blocks.{L}.hook_mlp_out"
        return "transcoder", None, None
    if layer and re.search(r"-res\b|-res/|_res/", text):
        return "sae", f"blocks.{layer.group(1)}.hook_resid_post", None
    if layer and re.search(r"-mlp\b|-mlp/", text):
        return "sae", f"blocks.{layer.group(1)}.hook_mlp_out", None
    return "sae", None, None


def load_gemma_scope_1(path: Path, *, kind: str | None = None) -> Dictionary:
    """Gemma Scope 1: ``params.npz`` with ``W_enc (D, F)``, ``W_dec (F, D)``, ``b_enc``,
    ``b_dec``, ``threshold`` (JumpReLU, no config; the input is not shifted by ``b_dec``).
    The hook comes from the path (``…-res/layer_20/…``: ``blocks.20.hook_resid_post``;
    ``…transcoders/layer_3/…``: a transcoder of MLP 3) where it says so."""
    shapes = npz_shapes(path)
    if "W_enc" not in shapes and "w_enc" in shapes:
        names = {n: n.lower() if n.startswith("W_") else n for n in
                 ("W_enc", "W_dec", "b_enc", "b_dec", "threshold")}
    else:
        names = {n: n for n in ("W_enc", "W_dec", "b_enc", "b_dec", "threshold")}
    if names["W_enc"] not in shapes or len(shapes[names["W_enc"]]) != 2:
        raise DictionaryFileError(f"{path}: missing tensor 'W_enc' (a 2-d array "
                                  f"(d_in, d_sae)); found {sorted(shapes)}")
    d_in, d_sae = shapes[names["W_enc"]]
    check_sizes(path, d_in=d_in, d_sae=d_sae)
    b_dec = shapes.get(names["b_dec"])
    d_out = b_dec[0] if b_dec is not None and len(b_dec) == 1 else d_in  # checked below
    check_sizes(path, d_out=d_out)
    found_kind, hook, out_hook = _gemma_scope_1_hook(path)
    kind = kind or found_kind
    layout = {"W_enc": (names["W_enc"], (d_in, d_sae), False),
              "b_enc": (names["b_enc"], (d_sae,), False),
              "W_dec": (names["W_dec"], (d_sae, d_out), False),
              "b_dec": (names["b_dec"], (d_out,), False),
              "threshold": (names["threshold"], (d_sae,), False)}
    tensors = read_weights(path, layout)
    return build_dictionary(path, tensors, kind=kind, activation="jumprelu",
                            apply_b_dec_to_input=False, hook_name=hook,
                            output_hook_name=out_hook,
                            meta={"format": "gemma-scope-1", "path": str(path)})


_HF_POINT = re.compile(r"^(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+)"
                       r"(?:\.(?P<sub>[\w.]+?))?\.(?P<io>output|input)$")
_HF_SUBS = {("", "output"): "hook_resid_post",
            ("pre_feedforward_layernorm", "output"): "mlp.hook_in",
            ("mlp", "input"): "mlp.hook_in",
            ("post_feedforward_layernorm", "output"): "hook_mlp_out",
            ("mlp", "output"): "mlp.hook_out"}


def gemma_scope_2_hook(name: str, where: Path) -> str:
    """handformer's hook name for a Hugging Face module point (``model.layers.6.output`` ->
    ``blocks.6.hook_resid_post``).

    Raises:
        DictionaryFileError: for a point handformer has no hook for (attention heads' input).
    """
    match = _HF_POINT.match(name) if isinstance(name, str) else None
    sub = (match.group("sub") or "", match.group("io")) if match else None
    if sub not in _HF_SUBS:
        raise _refuse(where, "hf_hook_point", name, "handformer maps a layer's output, its "
                      "MLP's input and output (pre/post_feedforward_layernorm); attention "
                      "output (o_proj.input) dictionaries are not supported")
    return f"blocks.{match.group(1)}.{_HF_SUBS[sub]}"


def load_gemma_scope_2(folder: Path) -> Dictionary:
    """Gemma Scope 2: ``params.safetensors`` (``w_enc (D, F)``, ``w_dec (F, O)``, ``b_enc``,
    ``b_dec``, ``threshold``, ``affine_skip_connection (D, O)`` in ``_affine`` transcoders)
    and ``config.json`` (``hf_hook_point_in``, ``hf_hook_point_out``, ``architecture``:
    ``jump_relu``). ``examples.safetensors`` is not read. Cross-layer transcoders (``w_dec``
    with a layer dim) are refused."""
    weights = folder / "params.safetensors"
    cfg_path = folder / "config.json"
    cfg = read_json(cfg_path) if cfg_path.is_file() else {}
    arch = cfg.get("architecture", "jump_relu")
    if arch not in ("jump_relu", "jumprelu"):
        raise _refuse(cfg_path, "architecture", arch, "Gemma Scope 2 dictionaries are "
                      "jump_relu")
    shapes, _ = safetensors_shapes(weights)
    if len(shapes.get("w_dec", ())) != 2:
        if len(shapes.get("w_dec", ())) > 2 or folder.name.startswith("clt"):
            raise _refuse(weights, "w_dec shape", shapes.get("w_dec"), "a cross-layer "
                          "transcoder (one decoder per later layer) is not supported")
        raise DictionaryFileError(f"{weights}: missing tensor 'w_dec' (a 2-d array "
                                  f"(d_sae, d_out)); found {sorted(shapes)}")
    if len(shapes.get("w_enc", ())) != 2:
        raise DictionaryFileError(f"{weights}: missing tensor 'w_enc' (a 2-d array "
                                  f"(d_in, d_sae)); found {sorted(shapes)}")
    d_in, d_sae = shapes["w_enc"]
    d_out = shapes["w_dec"][1]
    check_sizes(weights, d_in=d_in, d_sae=d_sae, d_out=d_out)
    point_in, point_out = cfg.get("hf_hook_point_in"), cfg.get("hf_hook_point_out")
    transcoder = ("affine_skip_connection" in shapes
                  or (point_out is not None and point_out != point_in)
                  or "transcoder" in folder.as_posix())
    hook = gemma_scope_2_hook(point_in, cfg_path) if point_in is not None else None
    out_hook = (gemma_scope_2_hook(point_out, cfg_path)
                if transcoder and point_out is not None else None)
    layout = {"W_enc": ("w_enc", (d_in, d_sae), False), "b_enc": ("b_enc", (d_sae,), False),
              "W_dec": ("w_dec", (d_sae, d_out), False), "b_dec": ("b_dec", (d_out,), False),
              "threshold": ("threshold", (d_sae,), False)}
    if "affine_skip_connection" in shapes:
        layout["W_skip"] = ("affine_skip_connection", (d_in, d_out), False)  # x @ W_skip
    tensors = read_weights(weights, layout)
    return build_dictionary(
        weights, tensors, kind="transcoder" if transcoder else "sae", activation="jumprelu",
        apply_b_dec_to_input=False, hook_name=hook, output_hook_name=out_hook,
        meta={"format": "gemma-scope-2", "path": str(folder),
              "model_name": cfg.get("model_name"), "l0": cfg.get("l0"),
              "hf_hook_point_in": point_in, "hf_hook_point_out": point_out})


# -- EleutherAI sparsify ----------------------------------------------------------------------

def _sparsify_hooks(folder: Path, transcode: bool) -> tuple[str | None, str | None]:
    match = re.fullmatch(r"(?:.*\.)?layers[._](\d+)(\.mlp)?", folder.name)
    if not match:
        return None, None
    L = match.group(1)
    if match.group(2):
        return ((f"blocks.{L}.mlp.hook_in", f"blocks.{L}.mlp.hook_out") if transcode
                else (f"blocks.{L}.mlp.hook_out", None))
    return f"blocks.{L}.hook_resid_post", None


def load_sparsify(folder: Path) -> Dictionary:
    """EleutherAI sparsify: ``cfg.json`` (``d_in``, ``num_latents`` or ``expansion_factor``,
    ``k``, ``activation``, ``transcode``, ``skip_connection``) + ``sae.safetensors``
    (``encoder.weight (F, D)``, ``encoder.bias``, ``W_dec (F, O)``, ``b_dec``,
    ``W_skip (O, D)``). TopK over ReLU'd pre-activations; an SAE subtracts ``b_dec`` from its
    input, a transcoder does not. The hook comes from the folder's name (``layers.6``: the
    layer's output; ``layers.6.mlp``: the MLP's output, or for a transcoder its input and
    output)."""
    cfg_path = folder / "cfg.json"
    cfg = read_json(cfg_path)
    activation = cfg.get("activation", "topk")
    if activation != "topk":
        raise _refuse(cfg_path, "activation", activation, "handformer reads sparsify's topk")
    d_in = _int(cfg_path, cfg, "d_in")
    d_sae = cfg.get("num_latents") or d_in * _int(cfg_path, cfg, "expansion_factor")
    k = _int(cfg_path, cfg, "k")
    transcode = cfg.get("transcode", False) is True
    skip = cfg.get("skip_connection", False) is True
    check_sizes(cfg_path, d_in=d_in, d_sae=d_sae)
    if not 0 < k <= d_sae:
        raise DictionaryFileError(f"{cfg_path}: k = {k} is out of range (1 .. {d_sae})")
    weights = folder / "sae.safetensors"
    layout = {"W_enc": ("encoder.weight", (d_sae, d_in), True),
              "b_enc": ("encoder.bias", (d_sae,), False),
              "W_dec": ("W_dec", (d_sae, d_in), False), "b_dec": ("b_dec", (d_in,), False)}
    if skip:
        layout["W_skip"] = ("W_skip", (d_in, d_in), True)  # x @ W_skip.T
    tensors = read_weights(weights, layout)
    hook, out_hook = _sparsify_hooks(folder, transcode)
    return build_dictionary(
        weights, tensors, kind="transcoder" if transcode else "sae", activation="topk", k=k,
        apply_b_dec_to_input=not transcode, hook_name=hook, output_hook_name=out_hook,
        meta={"format": "sparsify", "path": str(folder)})
