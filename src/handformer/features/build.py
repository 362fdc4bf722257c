"""Build a dictionary module around tensors already read (no second copy, no random init).

Every loader ends here: tensors in handformer's orientation (transposes are views), the
options a format's config gave, the hook names it declares.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from handformer.features.dictionary import Dictionary, SparseAutoencoder, Transcoder
from handformer.features.files import DictionaryFileError

__all__ = ["build_dictionary"]


def build_dictionary(path: Path, tensors: dict[str, Tensor], *, kind: str, activation: str,
                     k: int | None = None, apply_b_dec_to_input: bool = False,
                     normalize_activations: str = "none", input_scale: float = 1.0,
                     hook_name: str | None = None, output_hook_name: str | None = None,
                     meta: dict[str, Any] | None = None) -> Dictionary:
    """A :class:`SparseAutoencoder` (``kind="sae"``) or :class:`Transcoder` whose parameters
    are ``tensors`` (``W_enc (D, F)``, ``b_enc``, ``W_dec (F, O)``, ``b_dec``, ``threshold``
    for JumpReLU, ``W_skip (D, O)`` for a skip transcoder), used as they are.

    Raises:
        DictionaryFileError: for tensors of different dtypes or a bad option from the file.
    """
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) != 1:
        found = {name: str(t.dtype) for name, t in tensors.items()}
        raise DictionaryFileError(f"{path}: the tensors have different dtypes {found}; "
                                  "a dictionary has one")
    dtype = dtypes.pop()
    d_in, d_sae = tensors["W_enc"].shape
    d_out = tensors["W_dec"].shape[1]
    try:
        with torch.device("meta"):  # the module's own parameters: no memory, replaced below
            if kind == "transcoder":
                d: Dictionary = Transcoder(
                    d_in, d_sae, d_out, activation=activation, k=k,
                    skip="W_skip" in tensors, normalize_activations=normalize_activations,
                    input_scale=input_scale, dtype=dtype, hook_name=hook_name,
                    output_hook_name=output_hook_name)
            else:
                d = SparseAutoencoder(
                    d_in, d_sae, activation=activation, k=k,
                    apply_b_dec_to_input=apply_b_dec_to_input,
                    normalize_activations=normalize_activations, input_scale=input_scale,
                    dtype=dtype, hook_name=hook_name)
    except ValueError as exc:
        raise DictionaryFileError(f"{path}: {exc}") from exc
    for name, t in tensors.items():
        setattr(d, name, nn.Parameter(t, requires_grad=False))
    d.meta = dict(meta or {})
    return d
