"""GPT-2-family checkpoints on handformer's :class:`~handformer.CausalLM`: ``load_gpt2``.

A GPT-2 folder in Hugging Face's layout holds ``config.json``, ``model.safetensors`` and a
tokenizer: ``tokenizer.json``, or ``vocab.json`` + ``merges.txt`` (GPT-2's byte-level BPE).
GPT-2 is a pre-LN decoder-only Transformer (learned positions, ``gelu_new`` =
tanh-approximated GELU, a final ``ln_f``, LM head tied to the token embedding) and maps onto
``CausalLM`` exactly, with two layout differences handled here:

* GPT-2's ``Conv1D`` layers store weights transposed, ``(in, out)``; ``nn.Linear`` is
  ``(out, in)``;
* the query, key and value projections are one ``c_attn`` of width ``3 E`` (split in three).

Loading is strict and all-or-nothing: the file is first loaded, with
:func:`~handformer.weights.load_safetensors`, into a holder module with exactly
GPT-2's key names and shapes (every missing, unexpected or mis-shaped key reported at once);
only then are the tensors rearranged into a new ``CausalLM``. Keys may carry the
``transformer.`` prefix of ``GPT2LMHeadModel`` or not (``GPT2Model``). An untied LM head is
read from ``lm_head.weight``.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from handformer.models.causal_lm import CausalLM, CausalLMConfig
from handformer.pretrained.folders import (
    check_device,
    read_config_json,
    resolve_checkpoint_dir,
)
from handformer.pretrained.text_tokenizer import TextTokenizer, missing_tokenizer_note
from handformer.weights import load_safetensors, read_safetensors_header

__all__ = ["load_gpt2", "gpt2_config"]

ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
               "relu": "relu"}
_SKIPPED = re.compile(r"(^|\.)attn\.(masked_)?bias$")  # old causal-mask buffers


def gpt2_config(data: dict) -> CausalLMConfig:
    """A :class:`CausalLMConfig` from a GPT-2 ``config.json`` dict.

    Raises:
        ValueError: for another ``model_type`` or options handformer does not implement
            (cross-attention, ``scale_attn_by_inverse_layer_idx``, unscaled attention,
            unknown activations).
    """
    if not isinstance(data, dict) or data.get("model_type") != "gpt2":
        found = data.get("model_type") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"model_type is {found!r}, load_gpt2 reads 'gpt2' checkpoints")
    unsupported = [name for name, bad in (
        ("add_cross_attention", data.get("add_cross_attention", False)),
        ("scale_attn_by_inverse_layer_idx", data.get("scale_attn_by_inverse_layer_idx", False)),
        ("scale_attn_weights=False", not data.get("scale_attn_weights", True)),
    ) if bad]
    if unsupported:
        raise ValueError(f"GPT-2 options not supported by handformer: {unsupported}")
    activation = data.get("activation_function", "gelu_new")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation_function {activation!r} is not supported; known: "
                         f"{sorted(ACTIVATIONS)}")
    try:
        n_embd = data["n_embd"]
        return CausalLMConfig(
            vocab_size=data["vocab_size"], max_len=data["n_positions"], d_model=n_embd,
            num_heads=data["n_head"], num_layers=data["n_layer"],
            d_ff=data.get("n_inner") or 4 * n_embd, dropout=0.0,
            activation=ACTIVATIONS[activation], positional="learned", attention="full",
            tie_weights=bool(data.get("tie_word_embeddings", True)), norm_first=True,
            layer_norm_eps=data.get("layer_norm_epsilon", 1e-5), bias=True,
        )
    except KeyError as exc:
        raise ValueError(f"GPT-2 config.json lacks {exc.args[0]!r}") from None


def _holder_shapes(c: CausalLMConfig) -> dict[str, tuple[int, ...]]:
    """GPT-2's checkpoint keys (with the ``transformer.`` prefix) and shapes."""
    E, F = c.d_model, c.d_ff
    shapes = {"transformer.wte.weight": (c.vocab_size, E),
              "transformer.wpe.weight": (c.max_len, E),
              "transformer.ln_f.weight": (E,), "transformer.ln_f.bias": (E,)}
    for i in range(c.num_layers):
        p = f"transformer.h.{i}."
        shapes.update({
            p + "ln_1.weight": (E,), p + "ln_1.bias": (E,),
            p + "attn.c_attn.weight": (E, 3 * E), p + "attn.c_attn.bias": (3 * E,),
            p + "attn.c_proj.weight": (E, E), p + "attn.c_proj.bias": (E,),
            p + "ln_2.weight": (E,), p + "ln_2.bias": (E,),
            p + "mlp.c_fc.weight": (E, F), p + "mlp.c_fc.bias": (F,),
            p + "mlp.c_proj.weight": (F, E), p + "mlp.c_proj.bias": (E,),
        })
    if not c.tie_weights:
        shapes["lm_head.weight"] = (c.vocab_size, E)
    return shapes


def _holder(c: CausalLMConfig) -> nn.Module:
    """A parameter-only module with GPT-2's names and shapes (on the meta device)."""
    root = nn.Module()
    for name, shape in _holder_shapes(c).items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(torch.empty(shape, device="meta"),
                                                     requires_grad=False))
    if c.tie_weights:  # one tensor under both names, as in GPT2LMHeadModel
        root.add_module("lm_head", nn.Module())
        root.lm_head.weight = root.transformer.wte.weight
    return root


class _KeyMap:
    """File key -> holder key (adds ``transformer.`` to a ``GPT2Model`` file's keys); its
    ``file_key`` is the inverse, so missing keys are named as the file would hold them."""

    def __init__(self, prefixed: bool) -> None:
        self.prefixed = prefixed

    def __call__(self, key: str) -> str | None:
        if _SKIPPED.search(key):
            return None
        if self.prefixed or key.startswith("lm_head."):
            return key
        return "transformer." + key

    def file_key(self, holder_key: str) -> str:
        if self.prefixed or not holder_key.startswith("transformer."):
            return holder_key
        return holder_key[len("transformer."):]


def _to_causal_lm(holder: nn.Module, c: CausalLMConfig) -> dict[str, Tensor]:
    """Rearrange GPT-2 tensors into CausalLM's state dict (Conv1D -> Linear transposes)."""
    t = holder.transformer
    state = {"tok_emb.weight": t.wte.weight, "pos_emb.weight": t.wpe.weight,
             "norm.weight": t.ln_f.weight, "norm.bias": t.ln_f.bias}
    state["lm_head.weight"] = t.wte.weight if c.tie_weights else holder.lm_head.weight
    for i in range(c.num_layers):
        block = getattr(t.h, str(i))
        p = f"layers.{i}."
        w_qkv = block.attn.c_attn.weight.t()  # (E, 3E) -> (3E, E)
        b_qkv = block.attn.c_attn.bias
        for name, w, b in zip("qkv", w_qkv.chunk(3, dim=0), b_qkv.chunk(3), strict=True):
            state[p + f"self_attn.{name}_proj.weight"] = w.contiguous()  # (E, E)
            state[p + f"self_attn.{name}_proj.bias"] = b.contiguous()
        state.update({
            p + "self_attn.out_proj.weight": block.attn.c_proj.weight.t().contiguous(),
            p + "self_attn.out_proj.bias": block.attn.c_proj.bias,
            p + "norm1.weight": block.ln_1.weight, p + "norm1.bias": block.ln_1.bias,
            p + "norm3.weight": block.ln_2.weight, p + "norm3.bias": block.ln_2.bias,
            p + "ff.linear1.weight": block.mlp.c_fc.weight.t().contiguous(),  # (F, E)
            p + "ff.linear1.bias": block.mlp.c_fc.bias,
            p + "ff.linear2.weight": block.mlp.c_proj.weight.t().contiguous(),  # (E, F)
            p + "ff.linear2.bias": block.mlp.c_proj.bias,
        })
    return {k: v.detach() for k, v in state.items()}


def load_gpt2(path: str | os.PathLike, *, device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32, tokenizer: bool = True
              ) -> tuple[CausalLM, TextTokenizer | None]:
    """Load a GPT-2-family checkpoint onto a :class:`~handformer.CausalLM`.

    Args:
        path: a folder with ``config.json`` and ``model.safetensors`` (Hugging Face layout)
            and a tokenizer (``tokenizer.json``, or ``vocab.json`` + ``merges.txt``), or the
            ``model.safetensors`` file in it.
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
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if not isinstance(tokenizer, bool):
        raise TypeError(f"tokenizer must be True or False, got {tokenizer!r}")
    check_device(device)
    folder, weights = resolve_checkpoint_dir(path)
    data = read_config_json(folder)
    config = gpt2_config(data)
    header, _ = read_safetensors_header(weights)
    prefixed = any(k.startswith("transformer.") for k in header)
    holder = _holder(config)
    load_safetensors(holder, weights, _KeyMap(prefixed), assign=True)
    state = _to_causal_lm(holder, config)
    del holder
    with torch.device("meta"):
        model = CausalLM(config)
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_weights:
        model.lm_head.weight = model.tok_emb.weight
    model = model.to(device=device, dtype=dtype).eval()
    if not tokenizer:
        return model, None
    text_tokenizer = TextTokenizer.from_dir(folder, eos_token_id=data.get("eos_token_id"))
    if text_tokenizer is None:
        warnings.warn(f"{missing_tokenizer_note(folder)}; load_gpt2 returns the model with "
                      "tokenizer None (pass tokenizer=False to load the model alone without "
                      "this warning)", stacklevel=2)
    return model, text_tokenizer


def is_gpt2_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder whose ``config.json`` says ``model_type: gpt2``."""
    config = Path(path) / "config.json"
    try:
        return json.loads(config.read_text(encoding="utf-8")).get("model_type") == "gpt2"
    except (OSError, ValueError, AttributeError):
        return False
