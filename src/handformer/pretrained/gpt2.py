"""GPT-2-family checkpoints on handformer's :class:`~handformer.CausalLM`: ``load_gpt2``.

A GPT-2 folder in Hugging Face's layout holds ``config.json``, ``model.safetensors`` and a
tokenizer: ``tokenizer.json``, or ``vocab.json`` + ``merges.txt`` (GPT-2's byte-level BPE).
GPT-2 is a pre-LN decoder-only Transformer (learned positions, ``gelu_new`` =
tanh-approximated GELU, a final ``ln_f``, LM head tied to the token embedding) and maps onto
``CausalLM`` exactly; its config mapping and key map (``Conv1D`` transposes, the fused
``c_attn`` split in three) are the ``gpt2`` family's,
:mod:`handformer.pretrained.families.gpt2`, and the strict loader is the one every causal LM
shares, :func:`handformer.pretrained.load_lm`. ``load_gpt2`` is ``load_lm`` for folders that
must be GPT-2.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from handformer.models.causal_lm import CausalLM
from handformer.pretrained.families.gpt2 import ACTIVATIONS, gpt2_config
from handformer.tokenizers.byte_bpe import TextTokenizer

__all__ = ["load_gpt2", "gpt2_config", "ACTIVATIONS", "is_gpt2_dir"]


def load_gpt2(path: str | os.PathLike, *, device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32, tokenizer: bool = True
              ) -> tuple[CausalLM, TextTokenizer | None]:
    """Load a GPT-2-family checkpoint onto a :class:`~handformer.CausalLM`.

    Args:
        path: a folder with ``config.json`` and ``model.safetensors`` (Hugging Face layout)
            and a tokenizer (``tokenizer.json``, or ``vocab.json`` + ``merges.txt``), or the
            ``model.safetensors`` file in it. Keys may carry the ``transformer.`` prefix of
            ``GPT2LMHeadModel`` or not (``GPT2Model``); an untied head is ``lm_head.weight``.
        device: where to put the model.
        dtype: floating dtype of the parameters.
        tokenizer: look for the tokenizer; False loads the model alone (tokenizer None, no
            warning).

    Returns:
        ``(model, tokenizer)``: the model in eval mode; a :class:`TextTokenizer` when the
        folder has ``tokenizer.json`` or ``vocab.json`` + ``merges.txt``, else None with a
        ``UserWarning`` saying which files are missing.

    Raises:
        FileNotFoundError: for a missing folder, config or weights file.
        CheckpointError: (a ``ValueError``) for pickle checkpoints (the message says how to
            convert them), truncated or corrupt files, and missing, unexpected or mis-shaped
            keys (every one listed, in the file's names); no model is returned.
        ValueError: for a config that is not GPT-2 or uses unsupported options, or tokenizer
            files that cannot be read.
        TypeError: for a non-floating ``dtype``, or a ``path`` or ``device`` of the wrong type.
    """
    from handformer.pretrained.lm import _load

    return _load(path, dtype=dtype, device=device, attention=None,  # type: ignore[return-value]
                 tokenizer=tokenizer, caller="load_gpt2", expect="gpt2")


def is_gpt2_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder whose ``config.json`` says ``model_type: gpt2``."""
    config = Path(path) / "config.json"
    try:
        return json.loads(config.read_text(encoding="utf-8")).get("model_type") == "gpt2"
    except (OSError, ValueError, AttributeError):
        return False
