"""Sentence pooling as configured by a sentence-transformers checkpoint.

A sentence-transformers folder describes its pipeline in ``modules.json`` (Transformer ->
Pooling -> optional Normalize) and the pooling in ``1_Pooling/config.json``. This module reads
both and applies them to a :class:`BertModel`'s hidden states.

Shape letters: ``B`` batch, ``L`` length, ``E`` hidden size.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["SentencePooling", "MODES"]

# Order in which sentence-transformers concatenates several pooled vectors.
MODES = ("cls", "max", "mean", "mean_sqrt_len")
_KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")
_CONFIG_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens":
                "mean_sqrt_len"}


@dataclass(frozen=True)
class SentencePooling:
    """How token vectors become one sentence vector.

    Attributes:
        modes: pooling modes, concatenated in this order: ``"cls"``, ``"max"``, ``"mean"``
            (over real tokens), ``"mean_sqrt_len"`` (sum / sqrt(number of tokens)).
        normalize: L2-normalise the result (a ``Normalize`` module in ``modules.json``).
        max_seq_length: longest input, in tokens (``sentence_bert_config.json``), or None.
    """

    modes: tuple[str, ...] = ("mean",)
    normalize: bool = False
    max_seq_length: int | None = None

    def __post_init__(self) -> None:
        if not self.modes or any(m not in MODES for m in self.modes):
            raise ValueError(f"modes must be a non-empty subset of {MODES}, got {self.modes}")

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> SentencePooling | None:
        """Read a sentence-transformers pipeline; None when the folder has none.

        Raises:
            ValueError: for modules or pooling modes handformer does not implement (e.g. a
                ``Dense`` projection or weighted-mean pooling), so that embeddings are never
                silently different from the checkpoint's.
        """
        path = Path(path)
        modules_file = path / "modules.json"
        if not modules_file.is_file():
            return None
        modules = json.loads(modules_file.read_text(encoding="utf-8"))
        pooling_dir, normalize = None, False
        for m in modules:
            kind = str(m.get("type", "")).rsplit(".", 1)[-1]
            if kind not in _KNOWN_MODULES:
                raise ValueError(f"{modules_file}: module {m.get('type')!r} is not supported; "
                                 f"handformer implements {', '.join(_KNOWN_MODULES)}")
            if kind == "Pooling":
                pooling_dir = path / m.get("path", "")
            elif kind == "Normalize":
                normalize = True
        modes: tuple[str, ...] = ("mean",)
        if pooling_dir is not None and (pooling_dir / "config.json").is_file():
            cfg = json.loads((pooling_dir / "config.json").read_text(encoding="utf-8"))
            on = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
            unknown = [k for k in on if k not in _CONFIG_KEYS]
            if unknown:
                raise ValueError(f"{pooling_dir / 'config.json'}: {', '.join(unknown)} is not "
                                 f"supported; handformer implements {', '.join(_CONFIG_KEYS)}")
            modes = tuple(m for m in MODES if m in {_CONFIG_KEYS[k] for k in on}) or modes
        max_len = None
        st_config = path / "sentence_bert_config.json"
        if st_config.is_file():
            max_len = json.loads(st_config.read_text(encoding="utf-8")).get("max_seq_length")
        return cls(modes=modes, normalize=normalize, max_seq_length=max_len)

    def __call__(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        """Pool ``(B, L, E)`` hidden states over real tokens -> ``(B, E * len(modes))``."""
        keep = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (B, L, 1)
        count = keep.sum(dim=1).clamp(min=1e-9)  # (B, 1)
        parts = []
        for mode in self.modes:
            if mode == "cls":
                parts.append(hidden[:, 0])
            elif mode == "max":
                blocked = torch.finfo(hidden.dtype).min
                parts.append(hidden.masked_fill(keep == 0, blocked).amax(dim=1))
            else:
                summed = (hidden * keep).sum(dim=1)  # (B, E)
                parts.append(summed / (count if mode == "mean" else count.sqrt()))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return F.normalize(out, p=2, dim=-1) if self.normalize else out
