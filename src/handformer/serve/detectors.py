"""Head detector scores for the page's head grid: where to click first.

Every head is scored on one fixed probe per model: ``T`` random ordinary tokens, then the same
``T`` tokens again (after the model's leading special token). Ordinary text has few repeats,
so it gives an induction head nothing to find; the repeated half does. Three scores, each the
mean attention weight on the key the pattern names (so each lies in ``[0, 1]``):

* **previous token**: query ``i`` on key ``i - 1``;
* **induction**: a query in the second copy on the token that followed its first
  occurrence (``r_k`` at ``o + T + k`` on ``r_{k+1}`` at ``o + k + 1``);
* **first token**: query ``i`` on key 0 (many heads park their attention there).

The probe is the same for every call (seeded), so the scores are computed once per model and
kept on the :class:`~handformer.serve.state.ModelState`.

Shape letters: ``N`` layers, ``H`` heads, ``L`` probe length, ``T`` repeated span.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from handformer.serve.state import ModelState

__all__ = ["probe_ids", "scores_from_attention", "head_scores", "PROBE_TOKENS", "PROBE_SEED"]

PROBE_TOKENS = 24  # T: the repeated span
PROBE_SEED = 1234
_LOCK = threading.Lock()


def probe_ids(state: ModelState) -> tuple[list[int], int]:
    """The probe: ``(ids, o)`` with ``o`` leading special tokens, then ``T`` random ordinary
    tokens twice (encoders: ``[SEP]`` after them)."""
    tok = state.tokenizer
    V = len(tok) if hasattr(tok, "__len__") else state.model.config.vocab_size
    prefix: list[int] = []
    suffix: list[int] = []
    if state.causal:
        bos = getattr(tok, "bos_token_id", None)
        if isinstance(bos, int):
            prefix = [bos]
    else:
        cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        prefix = [cls] if cls is not None else []
        suffix = [sep] if sep is not None else []
    special = set(prefix) | set(suffix) | {getattr(tok, "eos_token_id", None),
                                           getattr(tok, "pad_token_id", None)}
    lo = V // 10 if V > 1000 else 0  # large vocabularies: skip the special / byte tokens
    pool = [i for i in range(lo, V) if i not in special]
    g = torch.Generator().manual_seed(PROBE_SEED)
    T = min(PROBE_TOKENS, max(2, (state.max_tokens - len(prefix) - len(suffix)) // 2))
    pick = torch.randint(len(pool), (T,), generator=g).tolist()
    span = [pool[k] for k in pick]
    return prefix + span + span + suffix, len(prefix)


def scores_from_attention(attn: Tensor, offset: int, T: int) -> dict[str, Tensor]:
    """The three scores of every head from the probe's weights.

    Args:
        attn: ``(N, H, L, L)`` attention weights on the probe.
        offset: ``o``, leading special tokens.
        T: the repeated span.

    Returns:
        ``{"previous_token", "induction", "first_token"}``, each ``(N, H)``.
    """
    N, H, L, _ = attn.shape
    i = torch.arange(1, L)
    prev = attn[:, :, i, i - 1].mean(-1)  # (N, H)
    first = attn[:, :, i, 0].mean(-1)  # (N, H)
    k = torch.arange(0, T - 1)
    q, key = offset + T + k, offset + k + 1
    induction = attn[:, :, q, key].mean(-1)  # (N, H)
    return {"previous_token": prev, "induction": induction, "first_token": first}


def head_scores(state: ModelState) -> dict[str, object]:
    """The detector scores of ``state``'s heads (computed on first call, then kept).

    Returns:
        ``{"probe": {...}, "previous_token": N x H, "induction": N x H,
        "first_token": N x H}`` with scores rounded to 4 decimals.
    """
    cached = getattr(state, "_head_scores", None)
    if cached is not None:
        return cached
    with _LOCK:
        cached = getattr(state, "_head_scores", None)
        if cached is not None:
            return cached
        ids, offset = probe_ids(state)
        T = (len(ids) - offset - (0 if state.causal else 1)) // 2
        batch = torch.tensor([ids], device=state.device)  # (1, L)
        with torch.inference_mode():
            if state.causal:
                out = state.model(batch, need_weights=True)
            else:
                out = state.model(input_ids=batch, attention_mask=torch.ones_like(batch),
                                  token_type_ids=torch.zeros_like(batch), need_weights=True)
        attn = torch.stack([a[0].float().cpu() for a in out.attentions])  # (N, H, L, L)
        scores = scores_from_attention(attn, offset, T)
        result: dict[str, object] = {
            "probe": {"tokens": len(ids), "repeated": T, "seed": PROBE_SEED,
                      "description": f"{T} random tokens, then the same {T} again"}}
        for name, value in scores.items():
            result[name] = torch.round(value * 10**4).div(10**4).tolist()
        state._head_scores = result
        return result
