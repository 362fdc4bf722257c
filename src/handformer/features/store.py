"""handformer's own dictionary file, and :func:`load_dictionary`, which recognises every layout.

handformer's format is one safetensors file: the tensors under their in-memory names and
orientations (``W_enc (d_in, d_sae)``, ``b_enc``, ``W_dec (d_sae, d_out)``, ``b_dec``,
``threshold``, ``W_skip (d_in, d_out)``), in their dtype, and the constructor's options as
JSON in the file's metadata (key ``handformer.dictionary``). It is written to a temporary file
beside the target, flushed and renamed, so a crash never leaves half a file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import save_file

from handformer.features.build import build_dictionary
from handformer.features.circuit_tracer import load_circuit_tracer
from handformer.features.dictionary import Dictionary, Transcoder
from handformer.features.files import DictionaryFileError, check_sizes
from handformer.features.formats import (
    load_gemma_scope_1,
    load_gemma_scope_2,
    load_saelens,
    load_sparsify,
    read_weights,
)
from handformer.weights import read_safetensors_header, write_atomically

__all__ = ["save_dictionary", "load_dictionary", "detect_format", "FORMATS"]

METADATA_KEY = "handformer.dictionary"
FILE_NAME = "dictionary.safetensors"
FORMAT_VERSION = 1
FORMATS = ("handformer", "saelens", "gemma-scope-1", "gemma-scope-2", "sparsify",
           "circuit-tracer")


def save_dictionary(dictionary: Dictionary, path: str | os.PathLike) -> Path:
    """Write ``dictionary`` in handformer's format (atomically).

    Args:
        dictionary: a :class:`SparseAutoencoder` or :class:`Transcoder`.
        path: a ``.safetensors`` file, or a folder (``dictionary.safetensors`` inside it,
            the folder created if needed).

    Returns:
        The file written.

    Raises:
        TypeError: for something that is not a dictionary.
        FileNotFoundError: when the file's folder does not exist.
    """
    if not isinstance(dictionary, Dictionary):
        raise TypeError(f"dictionary must be a SparseAutoencoder or Transcoder, got "
                        f"{type(dictionary).__name__}")
    path = Path(path)
    if path.suffix != ".safetensors":
        path.mkdir(parents=True, exist_ok=True)
        path = path / FILE_NAME
    config = {"version": FORMAT_VERSION, **dictionary.config()}
    tensors = {name: p.detach().to("cpu").contiguous()
               for name, p in dictionary.named_parameters()}
    metadata = {METADATA_KEY: json.dumps(config), "format": "pt"}
    return write_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def _load_handformer(path: Path) -> Dictionary:
    try:
        read_safetensors_header(path)  # truncated or corrupt: refused here, by name
        with safe_open(str(path), framework="pt") as f:
            header = {"__metadata__": f.metadata()}
    except ValueError as exc:
        raise DictionaryFileError(str(exc)) from exc
    raw = (header.get("__metadata__") or {}).get(METADATA_KEY)
    try:
        cfg = json.loads(raw) if isinstance(raw, str) else None
    except json.JSONDecodeError as exc:
        raise DictionaryFileError(f"{path}: its {METADATA_KEY!r} metadata is not JSON "
                                  f"({exc})") from exc
    if not isinstance(cfg, dict):
        raise DictionaryFileError(f"{path}: no {METADATA_KEY!r} metadata: not a dictionary "
                                  "saved by handformer")
    if cfg.get("version") != FORMAT_VERSION:
        raise DictionaryFileError(f"{path}: version = {cfg.get('version')!r} is not "
                                  f"supported (this handformer reads {FORMAT_VERSION})")
    if cfg.get("kind") not in ("sae", "transcoder"):
        raise DictionaryFileError(f"{path}: kind = {cfg.get('kind')!r} is neither 'sae' nor "
                                  "'transcoder'")
    d_in, d_sae, d_out = cfg.get("d_in"), cfg.get("d_sae"), cfg.get("d_out")
    check_sizes(path, d_in=d_in, d_sae=d_sae, d_out=d_out)
    layout = {"W_enc": ("W_enc", (d_in, d_sae), False), "b_enc": ("b_enc", (d_sae,), False),
              "W_dec": ("W_dec", (d_sae, d_out), False), "b_dec": ("b_dec", (d_out,), False)}
    if cfg.get("activation") == "jumprelu":
        layout["threshold"] = ("threshold", (d_sae,), False)
    if cfg.get("skip"):
        layout["W_skip"] = ("W_skip", (d_in, d_out), False)
    tensors = read_weights(path, layout)
    return build_dictionary(
        path, tensors, kind=cfg["kind"], activation=cfg.get("activation"), k=cfg.get("k"),
        apply_b_dec_to_input=cfg.get("apply_b_dec_to_input", False),
        normalize_activations=cfg.get("normalize_activations", "none"),
        input_scale=cfg.get("input_scale", 1.0), hook_name=cfg.get("hook_name"),
        output_hook_name=cfg.get("output_hook_name"),
        meta={"format": "handformer", "path": str(path)})


def detect_format(path: str | os.PathLike) -> tuple[str, Path]:
    """``(format, the file or folder its loader reads)`` for a local path.

    Raises:
        FileNotFoundError: for a path that does not exist or holds no known layout (the
            message lists what each format looks like).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no dictionary at {path} (load_dictionary reads local files "
                                "only; it never downloads)")
    if path.is_file():
        name, folder = path.name, path.parent
        if path.suffix in (".yaml", ".yml"):
            return "circuit-tracer", path
        if path.suffix == ".npz":
            return "gemma-scope-1", path
        if name == "sae_weights.safetensors":
            return "saelens", folder
        if name == "sae.safetensors":
            return "sparsify", folder
        if name == "params.safetensors":
            return "gemma-scope-2", folder
        if path.suffix == ".safetensors":
            return "handformer", path
    else:
        for marker, fmt, target in (
                ("sae_weights.safetensors", "saelens", path), ("sae.safetensors", "sparsify", path),
                ("params.safetensors", "gemma-scope-2", path),
                ("params.npz", "gemma-scope-1", path / "params.npz"),
                ("config.yaml", "circuit-tracer", path / "config.yaml"),
                (FILE_NAME, "handformer", path / FILE_NAME)):
            if (path / marker).is_file():
                return fmt, target
    raise FileNotFoundError(
        f"{path}: not a dictionary layout handformer knows: SAELens (cfg.json + "
        "sae_weights.safetensors), sparsify (cfg.json + sae.safetensors), Gemma Scope 2 "
        "(params.safetensors + config.json), Gemma Scope 1 (params.npz), circuit-tracer "
        f"(config.yaml), handformer ({FILE_NAME} or any .safetensors saved by "
        "save_dictionary)")


def load_dictionary(path: str | os.PathLike, *, kind: str | None = None
                    ) -> Dictionary | list[Transcoder]:
    """Load a dictionary from a local folder or file, whatever published layout it has.

    Recognised (see ``docs/features.md`` for the key and transpose table): SAELens (v5 and v6
    ``cfg.json`` + ``sae_weights.safetensors``), Gemma Scope 1 (``params.npz``), Gemma Scope 2
    (``params.safetensors`` + ``config.json``), EleutherAI sparsify (``cfg.json`` +
    ``sae.safetensors``), circuit-tracer transcoder sets (``config.yaml``: a list of
    transcoders, one per layer), and handformer's own (:func:`save_dictionary`). Tensors keep
    the file's dtype (``dictionary.to(torch.float32)`` converts) and do not require gradients
    (``dictionary.requires_grad_()`` to fine-tune).

    Args:
        path: a folder, or the file that names the layout.
        kind: ``"sae"`` or ``"transcoder"`` for a Gemma Scope 1 file whose path does not say
            (default: a transcoder when the path contains "transcoder").

    Returns:
        A :class:`SparseAutoencoder` or :class:`Transcoder` (``hook_name`` set where the
        format declares it; ``meta`` says where it came from), or for a circuit-tracer config
        the list of its transcoders.

    Raises:
        FileNotFoundError: nothing there, or no known layout.
        DictionaryFileError (a ``ValueError``): an unsupported field (named, with its value), a
            missing or mis-shaped tensor (named, with both shapes), a truncated file, NaN or
            infinity (naming the tensor), sizes out of range.
    """
    if kind not in (None, "sae", "transcoder"):
        raise ValueError(f"kind must be None, 'sae' or 'transcoder', got {kind!r}")
    fmt, target = detect_format(path)
    loaders: dict[str, Any] = {
        "saelens": load_saelens, "sparsify": load_sparsify,
        "gemma-scope-2": load_gemma_scope_2, "circuit-tracer": load_circuit_tracer,
        "gemma-scope-1": lambda p: load_gemma_scope_1(p, kind=kind),
        "handformer": _load_handformer}
    return loaders[fmt](target)
