"""circuit-tracer transcoder sets: a ``config.yaml`` listing one transcoder file per layer.

The config (circuit-tracer's ``configs/*.yaml`` and its Hugging Face repos)::

    model_name: "google/gemma-2-2b"
    model_kind: transcoder_set          # optional; cross_layer_transcoder is refused
    feature_input_hook: "ln2.hook_normalized"
    feature_output_hook: "hook_mlp_out"
    transcoders:                        # a list of {id, layer, filepath} or of paths
      - {id: "…-0", layer: 0, filepath: "layer_0/params.npz"}

Each listed file is read from the config's folder: a relative path, or an ``hf://repo/…``
URI whose path (or file name) lies in the folder; nothing is downloaded and nothing outside
the folder is read. ``.npz`` files are Gemma Scope transcoders (JumpReLU, ``W_enc (D, F)``),
``.safetensors`` files circuit-tracer's own (ReLU or, with a ``threshold``, JumpReLU;
``W_enc (F, D)``, ``W_dec (F, O)`` (older files ``(O, F)``), ``W_skip (O, D)``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from handformer.features.build import build_dictionary
from handformer.features.dictionary import Transcoder
from handformer.features.files import (
    MAX_CONFIG_BYTES,
    DictionaryFileError,
    check_sizes,
    safetensors_shapes,
)
from handformer.features.formats import load_gemma_scope_1, read_weights

__all__ = ["load_circuit_tracer", "read_yaml"]

_HOOKS = {"hook_resid_mid": "hook_resid_mid", "hook_resid_pre": "hook_resid_pre",
          "ln2.hook_normalized": "mlp.hook_in", "mlp.hook_in": "mlp.hook_in",
          "mlp.hook_out": "mlp.hook_out", "hook_mlp_out": "hook_mlp_out",
          "hook_resid_post": "hook_resid_post"}
MAX_LAYERS = 1024


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML mapping parsed with ``yaml.safe_load`` (no Python objects), at most 1 MiB.

    Raises:
        DictionaryFileError: for a large file, invalid YAML or not a mapping.
        ImportError: without PyYAML (``pip install handformer[features]``).
    """
    try:
        import yaml
    except ImportError as exc:  # pragma: no cover - PyYAML comes with the extras
        raise ImportError("reading a circuit-tracer config.yaml needs PyYAML: pip install "
                          "'handformer[features]'") from exc
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise DictionaryFileError(f"{path}: {size} bytes is too large for a config file")
    try:
        value = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise DictionaryFileError(f"{path}: not valid YAML ({exc})") from exc
    if not isinstance(value, dict):
        raise DictionaryFileError(f"{path}: expected a YAML mapping, got "
                                  f"{type(value).__name__}")
    return value


def _local_file(config: Path, entry: str) -> Path:
    """The file a config entry names, inside the config's folder."""
    folder = config.parent.resolve()
    if entry.startswith("hf://"):
        rest = entry[len("hf://"):].split("?", 1)[0]
        parts = rest.split("/")[2:]  # drop org/repo
        candidates = ["/".join(parts), parts[-1] if parts else ""]
    else:
        candidates = [entry]
    for candidate in candidates:
        if not candidate:
            continue
        path = (folder / candidate).resolve()
        if not path.is_relative_to(folder):
            raise DictionaryFileError(f"{config}: transcoder file {entry!r} lies outside the "
                                      f"config's folder {folder}; refused")
        if path.is_file():
            return path
    raise DictionaryFileError(f"{config}: transcoder file {entry!r} is not in {folder} "
                              "(handformer never downloads: put the file there)")


def _hook(config: Path, field: str, value: Any, layer: int) -> str:
    if value not in _HOOKS:
        raise DictionaryFileError(f"{config}: {field} = {value!r} is not supported (handformer "
                                  f"maps {sorted(_HOOKS)})")
    return f"blocks.{layer}.{_HOOKS[value]}"


def _entries(config: Path, cfg: dict[str, Any]) -> list[tuple[int, str]]:
    listed = cfg.get("transcoders")
    if not isinstance(listed, list) or not listed:
        raise DictionaryFileError(f"{config}: transcoders must be a non-empty list")
    if len(listed) > MAX_LAYERS:
        raise DictionaryFileError(f"{config}: {len(listed)} transcoders (at most {MAX_LAYERS})")
    entries = []
    for i, item in enumerate(listed):
        if isinstance(item, str):
            entries.append((i, item))
        elif isinstance(item, dict) and isinstance(item.get("filepath"), str):
            layer = item.get("layer", i)
            if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
                raise DictionaryFileError(f"{config}: transcoders[{i}].layer must be a "
                                          f"non-negative integer, got {layer!r}")
            entries.append((layer, item["filepath"]))
        else:
            raise DictionaryFileError(f"{config}: transcoders[{i}] must be a path or a "
                                      f"mapping with filepath, got {item!r}")
    layers = [layer for layer, _ in entries]
    if len(set(layers)) != len(layers):
        raise DictionaryFileError(f"{config}: two transcoders for one layer ({sorted(layers)})")
    return sorted(entries)


def _relu_transcoder(path: Path, activation: str | None, k: Any) -> dict[str, Any]:
    """circuit-tracer's safetensors layout -> tensors in handformer's orientation."""
    shapes, _ = safetensors_shapes(path)
    for key in ("b_enc", "b_dec", "W_enc", "W_dec"):
        if key not in shapes:
            raise DictionaryFileError(f"{path}: missing tensor {key!r}; found {sorted(shapes)}")
    if len(shapes["b_enc"]) != 1 or len(shapes["b_dec"]) != 1:
        raise DictionaryFileError(f"{path}: b_enc and b_dec must be 1-d, got "
                                  f"{shapes['b_enc']} and {shapes['b_dec']}")
    (d_sae,), (d_out,) = shapes["b_enc"], shapes["b_dec"]
    d_in = shapes["W_enc"][1] if len(shapes["W_enc"]) == 2 else 0
    check_sizes(path, d_in=d_in, d_sae=d_sae, d_out=d_out)
    old_dec = shapes["W_dec"] == (d_out, d_sae) and d_out != d_sae  # older files: (O, F)
    layout = {"W_enc": ("W_enc", (d_sae, d_in), True), "b_enc": ("b_enc", (d_sae,), False),
              "W_dec": ("W_dec", (d_out, d_sae) if old_dec else (d_sae, d_out), old_dec),
              "b_dec": ("b_dec", (d_out,), False)}
    if "W_skip" in shapes:
        layout["W_skip"] = ("W_skip", (d_out, d_in), True)  # x @ W_skip.T
    if "threshold" in shapes:
        layout["threshold"] = ("threshold", (d_sae,), False)
    act = activation or ("jumprelu" if "threshold" in shapes else "relu")
    if act == "jump_relu":
        act = "jumprelu"
    if act not in ("relu", "jumprelu", "topk"):
        raise DictionaryFileError(f"{path}: activation = {act!r} is not supported (relu, "
                                  "jump_relu, topk)")
    return {"tensors": read_weights(path, layout), "activation": act,
            "k": k if act == "topk" else None}


def load_circuit_tracer(config: Path) -> list[Transcoder]:
    """Every transcoder a circuit-tracer ``config.yaml`` lists, in layer order, each with
    its ``hook_name`` (input) and ``output_hook_name`` set (see the module docs).

    Raises:
        DictionaryFileError: for an unsupported field (named), a file outside the folder or
            missing, or a damaged transcoder file.
    """
    cfg = read_yaml(config)
    kind = cfg.get("model_kind", "transcoder_set")
    if kind != "transcoder_set":
        raise DictionaryFileError(f"{config}: model_kind = {kind!r} is not supported "
                                  "(handformer reads transcoder_set; cross-layer transcoders "
                                  "are not)")
    out: list[Transcoder] = []
    for layer, entry in _entries(config, cfg):
        hook_in = _hook(config, "feature_input_hook", cfg.get("feature_input_hook"), layer)
        hook_out = _hook(config, "feature_output_hook", cfg.get("feature_output_hook"), layer)
        path = _local_file(config, entry)
        if path.suffix == ".npz":
            t = load_gemma_scope_1(path, kind="transcoder")
            t.hook_name, t.output_hook_name = hook_in, hook_out
        elif path.suffix == ".safetensors":
            read = _relu_transcoder(path, cfg.get("activation"), cfg.get("k"))
            t = build_dictionary(path, read["tensors"], kind="transcoder",
                                 activation=read["activation"], k=read["k"],
                                 hook_name=hook_in, output_hook_name=hook_out)
        else:
            raise DictionaryFileError(f"{config}: transcoder file {entry!r} is neither .npz "
                                      "nor .safetensors")
        t.meta = {"format": "circuit-tracer", "path": str(path), "layer": layer,
                  "model_name": cfg.get("model_name")}
        out.append(t)  # type: ignore[arg-type]
    return out
