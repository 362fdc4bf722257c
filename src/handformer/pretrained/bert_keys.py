"""Hugging Face BERT checkpoint names <-> :class:`~handformer.pretrained.BertModel` names.

Hugging Face's ``BertModel`` and handformer's differ only in names: the file's
``encoder.layer.0.output.dense.bias`` is handformer's ``blocks.0.mlp.linear2.bias``.
:class:`BertKeyMap` translates both ways: file -> model to load (with task heads and
constant index buffers skipped), model -> file to report missing keys in the file's own names
and to save checkpoints that ``transformers`` reads.
"""

from __future__ import annotations

import re

__all__ = ["BertKeyMap", "bert_key_map"]

# Hugging Face layer sub-module -> handformer EncoderLayer sub-module.
_LAYER_NAMES = {
    "attention.self.query": "attn.q_proj",
    "attention.self.key": "attn.k_proj",
    "attention.self.value": "attn.v_proj",
    "attention.output.dense": "attn.out_proj",
    "attention.output.LayerNorm": "ln1",
    "intermediate.dense": "mlp.linear1",
    "output.dense": "mlp.linear2",
    "output.LayerNorm": "ln2",
}
_FILE_NAMES = {v: k for k, v in _LAYER_NAMES.items()}
_LAYER_KEY = re.compile(r"encoder\.layer\.(\d+)\.(.+)\.(weight|bias|gamma|beta)")
_MODEL_LAYER_KEY = re.compile(r"blocks\.(\d+)\.(.+)\.(weight|bias)")
_TASK_HEADS = ("cls.", "classifier.", "qa_outputs.")
_PREFIX = "bert."


class BertKeyMap:
    """The key map of a Hugging Face BERT checkpoint, for
    :func:`~handformer.weights.load_safetensors`.

    Args:
        prefixed: the checkpoint comes from a task model (``BertForMaskedLM`` ...), whose
            encoder keys start with ``bert.``; its task heads (``cls.``, ``classifier.``,
            ``qa_outputs.``) are skipped.

    Calling it maps a checkpoint key to the model's key (None = skipped on purpose; keys it
    does not know are returned unchanged and then reported as unexpected).
    :meth:`file_key` is the inverse.
    """

    def __init__(self, prefixed: bool) -> None:
        self.prefixed = bool(prefixed)

    def __call__(self, key: str) -> str | None:
        if self.prefixed:
            if key.startswith(_TASK_HEADS):
                return None
            if not key.startswith(_PREFIX):
                return key
            key = key[len(_PREFIX):]
        if key in ("embeddings.position_ids", "embeddings.token_type_ids"):
            return None  # constant index buffers, rebuilt by the model
        leaf = key.rsplit(".", 1)[-1]
        if leaf in ("gamma", "beta"):  # old LayerNorm names
            key = key[: -len(leaf)] + ("weight" if leaf == "gamma" else "bias")
        if key.startswith("embeddings.LayerNorm."):
            return "embeddings.norm." + key.rsplit(".", 1)[1]
        m = _LAYER_KEY.fullmatch(key)
        if m and m.group(2) in _LAYER_NAMES:
            i, part, leaf = m.groups()
            return f"blocks.{i}.{_LAYER_NAMES[part]}.{leaf}"
        return key

    def file_key(self, model_key: str) -> str:
        """The checkpoint key a :class:`BertModel` key is loaded from (with ``bert.`` when
        prefixed), e.g. ``blocks.0.mlp.linear2.bias`` ->
        ``encoder.layer.0.output.dense.bias``."""
        key = model_key
        if key.startswith("embeddings.norm."):
            key = "embeddings.LayerNorm." + key[len("embeddings.norm."):]
        m = _MODEL_LAYER_KEY.fullmatch(key)
        if m and m.group(2) in _FILE_NAMES:
            i, part, leaf = m.groups()
            key = f"encoder.layer.{i}.{_FILE_NAMES[part]}.{leaf}"
        return _PREFIX + key if self.prefixed else key

    def __repr__(self) -> str:
        return f"BertKeyMap(prefixed={self.prefixed})"


def bert_key_map(prefixed: bool) -> BertKeyMap:
    """Hugging Face BERT checkpoint key -> :class:`BertModel` key (None = skipped).

    Args:
        prefixed: the checkpoint comes from a task model (``BertForMaskedLM`` ...), whose
            encoder keys start with ``bert.``; its task heads (``cls.``, ``classifier.``,
            ``qa_outputs.``) are skipped.

    Returns:
        A :class:`BertKeyMap` for :func:`handformer.weights.load_safetensors`: keys it does
        not know are returned unchanged (and then reported as unexpected); its ``file_key``
        method names missing keys as the file should hold them.
    """
    return BertKeyMap(prefixed)
