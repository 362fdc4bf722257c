"""Head detector scores for the page's head grid: where to click first.

Every head is scored on one fixed probe per model: ``T`` random ordinary tokens, then the same
``T`` tokens again (after the model's leading special token). Ordinary text has few repeats,
so it gives an induction head nothing to find; the repeated half does. Three scores, each
:func:`handformer.inspect.detect_heads`' (TransformerLens' "mul" score: the head's attention
mass on the pattern over its whole attention mass, in ``[0, 1]``), computed by
:func:`handformer.inspect.detection_scores` from one forward's attention, so a number on the
page is what ``detect_heads(model, probe, kind)`` returns for the same probe:

* **previous token** (kind ``"previous_token"``): query ``i`` on key ``i - 1``;
* **induction** (``"induction"``): query ``i`` on the token that followed an earlier
  occurrence of its token (on the probe: ``r_k`` at ``o + T + k`` on ``o + k + 1``). The first
  copy has nothing to find, so a perfect induction head scores about 0.5 here;
* **first token** (``"bos"``): query ``i`` on key 0 (many heads park their attention there).

The wire format adds, per score, ``probe.perfect``: what a perfect head would score on this
probe (the share of queries that have a target; :func:`handformer.inspect.detect.perfect_score`),
which the page scales its outline threshold by.

The probe is the same for every call (seeded), so the scores are computed once per model and
kept on the :class:`~handformer.serve.state.ModelState`.

Shape letters: ``N`` layers, ``H`` heads, ``L`` probe length, ``T`` repeated span.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from handformer.inspect.detect import detection_scores, perfect_score
from handformer.serve.state import ModelState

__all__ = ["probe_ids", "scores_from_attention", "head_scores", "DETECTORS", "PROBE_TOKENS",
           "PROBE_SEED"]

# The page's name of each score -> its detect_heads kind.
DETECTORS = {"previous_token": "previous_token", "induction": "induction", "first_token": "bos"}

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


def scores_from_attention(attn: Tensor, ids: list[int] | Tensor) -> dict[str, Tensor]:
    """The page's scores of every head from one sequence's attention weights.

    Args:
        attn: ``(N, H, L, L)`` attention weights on ``ids``.
        ids: the ``L`` token ids (the probe).

    Returns:
        ``{"previous_token", "induction", "first_token"}``, each ``(N, H)`` float64:
        :func:`~handformer.inspect.detection_scores` of kinds ``previous_token``,
        ``induction``, ``bos``.
    """
    tokens = torch.as_tensor(ids)
    return {name: detection_scores(attn, tokens, kind) for name, kind in DETECTORS.items()}


def head_scores(state: ModelState) -> dict[str, object]:
    """The detector scores of ``state``'s heads (computed on first call, then kept).

    Returns:
        ``{"probe": {...}, "previous_token": N x H, "induction": N x H,
        "first_token": N x H}`` with scores rounded to 4 decimals: those of
        ``detect_heads(state.model, torch.tensor([probe_ids(state)[0]]), kind)``.
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
        tokens = torch.tensor(ids)
        batch = torch.tensor([ids], device=state.device)  # (1, L)
        with torch.inference_mode():
            if state.causal:
                out = state.model(batch, need_weights=True)
            else:
                out = state.model(input_ids=batch, attention_mask=torch.ones_like(batch),
                                  token_type_ids=torch.zeros_like(batch), need_weights=True)
        attn = torch.stack([a[0].cpu() for a in out.attentions])  # (N, H, L, L)
        scores = scores_from_attention(attn, tokens)
        perfect = {name: round(perfect_score(tokens, kind), 4)
                   for name, kind in DETECTORS.items()}
        result: dict[str, object] = {
            "probe": {"tokens": len(ids), "repeated": T, "seed": PROBE_SEED,
                      "description": f"{T} random tokens, then the same {T} again",
                      "perfect": perfect}}
        for name, value in scores.items():
            result[name] = torch.round(value * 10**4).div(10**4).tolist()
        state._head_scores = result
        return result
