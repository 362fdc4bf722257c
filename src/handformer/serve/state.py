"""The model a server holds: loaded once, and one view of it per attention kind.

A request may ask for any attention kind (full, local window, strided stride, linear). The
loaded model is never changed: for each kind a second model is made lazily that shares every
parameter and buffer tensor with the loaded one (``copy.deepcopy`` told to keep the tensors)
and differs only in its attention modules, which hold no weights. Two requests with different
kinds run on different module trees at the same time; memory grows by a few kilobytes per kind.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from handformer.attention.kinds import AttentionKind
from handformer.attention.registry import KIND_NAMES, KIND_OPTIONS, attention_kind
from handformer.viz.budget import VIEW_BUDGET, view_limit  # noqa: F401 (re-exported)

__all__ = ["AttentionChoice", "ModelState", "KINDS"]

KINDS = KIND_NAMES  # ("full", "local", "strided", "linear")
MAX_VARIANTS = 16  # models kept for distinct (kind, window, stride, global tokens) settings
# VIEW_BUDGET, view_limit: the attention values one request may compute (layers x heads x
# tokens²), the budget ``handformer viz`` keeps too (handformer.viz.budget).


@dataclass(frozen=True)
class AttentionChoice:
    """One attention setting asked for by a request (validated by :meth:`make`).

    Attributes:
        kind: ``"full"``, ``"local"``, ``"strided"`` or ``"linear"``.
        window_size: keys each query sees with ``local`` (odd for encoders).
        stride: the stride of ``strided``.
        global_tokens: leading tokens every query sees with ``strided``.
    """

    kind: str = "full"
    window_size: int = 5
    stride: int = 3
    global_tokens: int = 1

    def key(self) -> tuple[object, ...]:
        """What distinguishes two settings (unused options do not)."""
        if self.kind == "local":
            return ("local", self.window_size)
        if self.kind == "strided":
            return ("strided", self.stride, self.global_tokens)
        return (self.kind,)

    def make(self) -> AttentionKind:
        """A new attention module of this kind.

        Raises:
            ValueError: for a kind or option the attention module rejects.
        """
        options = {name: getattr(self, name) for name, kind in KIND_OPTIONS.items()
                   if kind == self.kind}
        return attention_kind(self.kind, **options)  # the CLI's and the loaders' names

    def describe(self) -> str:
        """The setting in words, e.g. ``"local attention, window 5"``."""
        if self.kind == "local":
            return f"local attention, window {self.window_size}"
        if self.kind == "strided":
            return (f"strided attention, stride {self.stride}, {self.global_tokens} global "
                    f"token{'s' * (self.global_tokens != 1)}")
        if self.kind == "linear":
            return "linear attention (elu+1 features)"
        return "full attention"

    def as_dict(self) -> dict[str, object]:
        """The setting as JSON: the kind and the options it uses."""
        out: dict[str, object] = {"kind": self.kind, "description": self.describe()}
        if self.kind == "local":
            out["window_size"] = self.window_size
        elif self.kind == "strided":
            out |= {"stride": self.stride, "global_tokens": self.global_tokens}
        return out


def _layers(model: nn.Module) -> list[nn.Module]:
    """The model's transformer layers (each with ``attn``): BertModel's and CausalLM's
    ``blocks``."""
    return list(model.blocks)


def _is_causal_folder(folder: str | Path) -> bool:
    """A causal LM: a folder ``load_lm`` reads, a ``.gguf`` file or a shipped name (a string:
    a shipped name is not a path)."""
    from handformer.pretrained.lm import is_causal_source

    return is_causal_source(folder)


def _load_causal(source: str | Path, device: torch.device, quantize: str | None = None
                 ) -> tuple[nn.Module, object]:
    """``load_lm``'s model and tokenizer (a ``handformer train`` run's character vocabulary
    where it has no other; a folder without any is an error)."""
    from handformer.pretrained.lm import load_lm_with_tokenizer

    return load_lm_with_tokenizer(source, device=device, quantize=quantize)


class ModelState:
    """A loaded model, its tokenizer, and its attention-kind views.

    Args:
        folder: a BERT-family folder (default: the bundled all-MiniLM-L6-v2), or a causal LM
            :func:`~handformer.pretrained.load_lm` reads: a GPT-2 / Llama / Mistral / Qwen /
            Gemma / ``handformer train`` folder, a ``.gguf`` file or a shipped name.
        device: where the model runs.
        quantize: "int8" or "int4" for quantized linear layers in a causal LM (see
            ``load_lm``); None: float.

    Attributes:
        causal: True for a causal language model, False for an encoder.
        name: the model's name in responses (the folder name).
        model: the loaded model (never modified).
        tokenizer: its tokenizer.
        num_layers, num_heads: sizes.
        max_tokens: the longest input a request may use; longer text is cut (the model's
            context, or fewer where every head's weights would pass :data:`VIEW_BUDGET`).
        context: the model's own context length.
        embed_tokens: the longest input of a sentence embedding (encoders: the checkpoint's
            sentence-transformers ``max_seq_length``, as :func:`handformer.embed` uses).
        default_attention: the attention the model was loaded with (full for BERT); what
            a request without ``attention`` gets.

    Raises:
        FileNotFoundError, ValueError: from the loaders, for folders that are not models.
    """

    def __init__(self, folder: str | Path | None = None, *, device: str = "cpu",
                 quantize: str | None = None) -> None:
        self.device = torch.device(device)
        path = None if folder is None else Path(folder)
        self.causal = folder is not None and _is_causal_folder(
            folder if isinstance(folder, str) else path)
        if self.causal:
            model, tokenizer = _load_causal(folder if isinstance(folder, str) else path,
                                            self.device, quantize)
            c = model.config
            self.num_layers, self.num_heads, self.max_tokens = c.num_layers, c.num_heads, c.max_len
            self.embed_tokens = self.max_tokens
            self.default_attention = AttentionChoice(
                c.attention, window_size=c.window_size or 5, stride=c.stride or 3,
                global_tokens=0)
        else:
            from handformer.pretrained import load_bert

            model, tokenizer = load_bert(path, device=self.device)
            c = model.config
            self.num_layers, self.num_heads = c.num_hidden_layers, c.num_attention_heads
            pooling = model.sentence_pooling
            self.max_tokens = self.embed_tokens = tokenizer.max_length
            if pooling is not None and pooling.max_seq_length is not None:
                self.embed_tokens = min(self.max_tokens, pooling.max_seq_length)
            self.default_attention = AttentionChoice()
        self.context = self.max_tokens  # the model's own limit
        self.max_tokens = min(self.max_tokens, view_limit(self.num_layers, self.num_heads))
        self.embed_tokens = min(self.embed_tokens, self.max_tokens)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = "all-MiniLM-L6-v2" if path is None else (path.resolve().name or str(path))
        self._variants: OrderedDict[tuple[object, ...], nn.Module] = OrderedDict()
        self._lock = threading.Lock()

    def variant(self, choice: AttentionChoice) -> nn.Module:
        """The model with ``choice``'s attention in every layer, sharing the loaded weights.

        The attention the model was loaded with gives the loaded model itself.

        Raises:
            ValueError: for options the attention module rejects.
        """
        key = choice.key()
        if key == self.default_attention.key():
            return self.model
        with self._lock:
            if key in self._variants:
                self._variants.move_to_end(key)
                return self._variants[key]
        kinds = [choice.make() for _ in range(self.num_layers)]  # validates first
        shared = {id(t): t for t in (*self.model.parameters(), *self.model.buffers())}
        model = copy.deepcopy(self.model, memo=shared)
        for layer, kind in zip(_layers(model), kinds, strict=True):
            layer.attn.attention = kind.to(self.device)
            if not kind.supports_dropout:
                layer.attn.dropout = 0.0
        model.eval()
        with self._lock:
            self._variants[key] = model
            while len(self._variants) > MAX_VARIANTS:
                self._variants.popitem(last=False)
        return model

    def info(self) -> dict[str, object]:
        """What ``GET /api/model`` returns."""
        config = self.model.config
        kv = getattr(config, "num_kv_heads", None) or self.num_heads
        return {"model": self.name, "type": "causal-lm" if self.causal else "encoder",
                "layers": self.num_layers, "heads": self.num_heads, "kv_heads": kv,
                "chat_template": bool(self.tokenizer.chat_template),
                "max_tokens": self.max_tokens, "context": self.context,
                "embed_tokens": self.embed_tokens,
                "attention_kinds": list(KINDS),
                "default_attention": self.default_attention.as_dict(),
                "device": str(self.device),
                "endpoints": ["/api/model", "/api/models", "/api/heads", "/api/run", "/api/ablate",
                              "/api/rollout"]
                + (["/api/generate", "/api/attribution"] if self.causal else [])}
