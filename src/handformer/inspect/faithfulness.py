"""How far to trust an attention picture: attention-based token scores against ablation.

For one input to a BERT-family encoder, four per-token scores:

* ``raw attention`` - the last layer's attention, heads averaged, the ``[CLS]`` row (or the
  mean over rows);
* ``rollout`` - the same row of :func:`~handformer.inspect.rollout.attention_rollout`;
* ``flow`` - the same row of :func:`~handformer.inspect.flow.attention_flow`;
* ``ablation`` - what the model actually uses: remove (or mask) each token in turn and
  measure how far the sentence embedding moves, ``1 - cosine(ablated, original)``; the
  embedding is pooled as :func:`handformer.pretrained.embed` pools it.

and their Spearman rank correlations (as in Table 3 of Abnar & Zuidema 2020): a high
correlation of a method with ``ablation`` means its picture ranks tokens the way the model's
output depends on them.

Shape letters: ``M`` methods, ``L`` length, ``E`` hidden size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from handformer.inspect.flow import MAX_TOKENS, attention_flow
from handformer.inspect.rollout import attention_rollout

__all__ = ["Faithfulness", "faithfulness", "spearman", "rank_average", "METHODS"]

METHODS = ("raw attention", "rollout", "flow", "ablation")
ROWS = ("cls", "mean")
ABLATIONS = ("remove", "mask")


def rank_average(x: Sequence[float] | np.ndarray | Tensor) -> np.ndarray:
    """Ranks 1..n of ``x``, ties given the average of the ranks they span (float64)."""
    values = np.asarray(x.detach().cpu() if isinstance(x, Tensor) else x, dtype=np.float64)
    if values.ndim != 1:
        raise ValueError(f"rank_average takes a 1-D sequence, got shape {values.shape}")
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values))
    start = 0
    while start < len(values):  # one group of equal values per step
        end = start
        while end + 1 < len(values) and values[order[end + 1]] == values[order[start]]:
            end += 1
        ranks[order[start:end + 1]] = (start + end) / 2 + 1  # mean of ranks start+1..end+1
        start = end + 1
    return ranks


def spearman(x: Sequence[float] | np.ndarray | Tensor,
             y: Sequence[float] | np.ndarray | Tensor) -> float:
    """Spearman's rank correlation: the Pearson correlation of the average ranks.

    Args:
        x, y: two sequences of numbers of the same length.

    Returns:
        A float in ``[-1, 1]``, or NaN when either input is constant (no ranking).

    Raises:
        ValueError: for inputs of different lengths or fewer than 2 values.
    """
    rx, ry = rank_average(x), rank_average(y)
    if len(rx) != len(ry) or len(rx) < 2:
        raise ValueError(f"spearman needs two sequences of the same length >= 2, got "
                         f"{len(rx)} and {len(ry)}")
    dx, dy = rx - rx.mean(), ry - ry.mean()
    denom = float(np.sqrt((dx * dx).sum() * (dy * dy).sum()))
    return float((dx * dy).sum() / denom) if denom > 0 else float("nan")


@dataclass(frozen=True)
class Faithfulness:
    """Per-token scores of several methods on one input and their rank correlations.

    Attributes:
        tokens: the ``L`` token strings.
        methods: the ``M`` method names (rows of ``scores``).
        scores: ``(M, L)`` float64, one row per method (higher = more important).
        correlation: ``(M, M)`` Spearman correlations over ``positions``.
        positions: the token positions the correlations are computed on (by default the
            ordinary tokens: ``[CLS]`` / ``[SEP]`` left out).
        row: ``"cls"`` or ``"mean"``, the attention row used.
        ablation: ``"remove"`` or ``"mask"``.
    """

    tokens: list[str]
    methods: tuple[str, ...]
    scores: Tensor
    correlation: Tensor
    positions: list[int]
    row: str
    ablation: str

    def to_markdown(self, *, scores: bool = False) -> str:
        """The correlation table as GitHub markdown (and the scores per token if asked)."""
        head = "| Spearman | " + " | ".join(self.methods) + " |"
        lines = [head, "|---" * (len(self.methods) + 1) + "|"]
        for name, row in zip(self.methods, self.correlation.tolist(), strict=True):
            lines.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in row) + " |")
        if scores:
            lines += ["", "| token | " + " | ".join(self.methods) + " |",
                      "|---" * (len(self.methods) + 1) + "|"]
            for j, tok in enumerate(self.tokens):
                cells = " | ".join(f"{v:.4f}" for v in self.scores[:, j].tolist())
                safe = tok.replace("|", "\\|")
                lines.append(f"| `{safe}` | {cells} |")
        return "\n".join(lines) + "\n"


def _mask_id(tokenizer: object) -> int:
    """The id of ``[MASK]`` in a :class:`~handformer.pretrained.BertTokenizer`."""
    found = tokenizer.token_to_id("[MASK]") if hasattr(tokenizer, "token_to_id") else None
    if found is None:
        raise ValueError("ablation='mask' needs a [MASK] token, and this tokenizer has none; "
                         "use ablation='remove'")
    return int(found)


def _ablated_batch(ids: list[int], types: list[int], ablation: str, mask_id: int | None
                   ) -> dict[str, Tensor]:
    """``L`` variants of one input, variant ``j`` without token ``j``: ``(L, L or L-1)``."""
    L = len(ids)
    if ablation == "mask":
        input_ids = torch.tensor([ids] * L)  # (L, L)
        input_ids[torch.arange(L), torch.arange(L)] = mask_id
        return {"input_ids": input_ids, "token_type_ids": torch.tensor([types] * L),
                "attention_mask": torch.ones(L, L, dtype=torch.long)}
    keep = ~torch.eye(L, dtype=torch.bool)  # (L, L), row j drops token j
    every = torch.tensor(ids).expand(L, L)
    return {"input_ids": every[keep].view(L, L - 1),
            "token_type_ids": torch.tensor(types).expand(L, L)[keep].view(L, L - 1),
            "attention_mask": torch.ones(L, L - 1, dtype=torch.long)}


def faithfulness(model: torch.nn.Module, tokenizer: object, text: str, *, row: str = "cls",
                 ablation: str = "remove", include_special: bool = False,
                 flow_max_tokens: int = MAX_TOKENS) -> Faithfulness:
    """Raw attention, rollout, flow and token ablation on one text, side by side.

    Args:
        model: a :class:`~handformer.pretrained.BertModel` (e.g. ``load_bert()``'s).
        tokenizer: its tokenizer.
        text: one input text.
        row: ``"cls"`` (default) scores each token by the ``[CLS]`` row of the attention,
            rollout and flow; ``"mean"`` by the mean over all rows (flow then solves
            ``L²`` max-flows instead of ``L``).
        ablation: ``"remove"`` (default) deletes each token in turn; ``"mask"`` replaces it
            by ``[MASK]``.
        include_special: also correlate over ``[CLS]`` / ``[SEP]`` (default: ordinary
            tokens only; special tokens soak up attention for reasons of their own).
        flow_max_tokens: passed to :func:`attention_flow` as ``max_tokens``.

    Returns:
        A :class:`Faithfulness` with the scores, the Spearman table and ``to_markdown()``.

    Raises:
        TypeError: for a model that is not a BERT-family encoder (a causal LM).
        ValueError: for an unknown row or ablation, a text with fewer than 2 tokens to
            correlate, or a text longer than ``flow_max_tokens``.
    """
    if not hasattr(model, "embeddings") or not hasattr(model, "blocks"):
        raise TypeError(f"faithfulness needs a BERT-family encoder (BertModel, e.g. "
                        f"load_bert()'s) and its tokenizer, got {type(model).__name__}; for a "
                        "causal language model, use attention_rollout or attention_flow on "
                        "model(ids, need_weights=True).attentions")
    if row not in ROWS:
        raise ValueError(f"row must be one of {ROWS}, got {row!r}")
    if ablation not in ABLATIONS:
        raise ValueError(f"ablation must be one of {ABLATIONS}, got {ablation!r}")
    from handformer.pretrained.pooling import SentencePooling

    enc = tokenizer.encode_batch([text])[0]
    L = len(enc.ids)
    positions = [j for j in range(L) if include_special or not enc.special_tokens_mask[j]]
    if len(positions) < 2:
        raise ValueError(f"text has {len(positions)} token(s) to rank; faithfulness needs at "
                         f"least 2")
    mask_id = _mask_id(tokenizer) if ablation == "mask" else None
    pooling = getattr(model, "sentence_pooling", None) or SentencePooling()
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            batch = {k: v.to(device) for k, v in tokenizer.pad([enc]).items()}
            out = model(**batch, need_weights=True)
            full = pooling(out.last_hidden_state, batch["attention_mask"])  # (1, E)
            variants = {k: v.to(device) for k, v in
                        _ablated_batch(enc.ids, enc.type_ids, ablation, mask_id).items()}
            ablated = pooling(model(**variants).last_hidden_state,
                              variants["attention_mask"])  # (L, E)
    finally:
        model.train(was_training)
    attentions = [a.double().cpu() for a in out.attentions]
    raw = attentions[-1][0].mean(dim=0)  # (L, L), heads averaged
    rolled = attention_rollout(attentions)[0]  # (L, L)
    if row == "cls":
        flow = attention_flow(attentions, rows=0, max_tokens=flow_max_tokens)[0, 0]
        raw_s, roll_s = raw[0], rolled[0]
    else:
        flow = attention_flow(attentions, rows="all", max_tokens=flow_max_tokens)[0].mean(0)
        raw_s, roll_s = raw.mean(0), rolled.mean(0)
    change = 1.0 - F.cosine_similarity(ablated.double(), full.double(), dim=-1)  # (L,)
    scores = torch.stack([raw_s, roll_s, flow.double(), change.cpu()])  # (M, L)
    picked = scores[:, positions]
    M = len(METHODS)
    corr = torch.tensor([[spearman(picked[a], picked[b]) for b in range(M)] for a in range(M)],
                        dtype=torch.float64)
    return Faithfulness(list(enc.tokens), METHODS, scores, corr, positions, row, ablation)
