"""Which head to show first: the one ``handformer viz`` draws in head.png and the page opens on.

The head holding the strongest link between two ordinary tokens at least two words apart
(not within "didn't", not to the neighbour; special and unknown tokens left out, and the first
position, the attention sink where many heads park their weight, unless ``include_sink``).
When no such pair exists (a short text, or one the model reads as ``[UNK] [UNK] ...``), the
condition is relaxed step by step: any two ordinary tokens of different words, then any two
positions other than the first key, so the choice is never an arbitrary fixed head.

Shape letters: ``N`` layers, ``H`` heads, ``L`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from handformer.viz.data import as_attention_layers, summarize

__all__ = ["choose_head", "left_out", "word_index"]


def word_index(text: str, offsets: Sequence[tuple[int, int]]) -> list[int]:
    """Per token, the index of the whitespace-separated word its characters start in.

    Args:
        text: the text that was tokenized.
        offsets: per token, its ``(start, end)`` character offsets in ``text``.

    Returns:
        One word index per token (tokens past the text, e.g. ``[SEP]``, get one more).
    """
    word_at, word, inside = [], -1, False
    for ch in text:
        if not ch.isspace() and not inside:
            word += 1
        inside = not ch.isspace()
        word_at.append(max(word, 0))
    return [word_at[start] if start < len(word_at) else word + 1 for start, _ in offsets]


def left_out(tokens: Sequence[str], special: Sequence[bool] | None = None,
             unknown: Sequence[bool] | None = None) -> list[bool]:
    """Per position, whether links to and from it are left out: special tokens (by default
    labels written like ``[CLS]`` or ``<bos>``) and the model's unknown tokens.

    Args:
        tokens: one label per position.
        special: per position, True for special tokens (default: from the labels).
        unknown: per position, True for the model's unknown token.

    Returns:
        One bool per position.
    """
    if special is None:
        skip = [len(t) > 2 and t.startswith(("[", "<")) and t.endswith(("]", ">"))
                for t in tokens]
    else:
        skip = [bool(a) for a in special]
    if unknown is not None:
        skip = [a or bool(b) for a, b in zip(skip, unknown, strict=True)]
    return skip


def choose_head(attentions: object, tokens: Sequence[str], *,
                special: Sequence[bool] | None = None, words: Sequence[int] | None = None,
                unknown: Sequence[bool] | None = None, layer: int | None = None,
                head: int | None = None, include_sink: bool = False) -> tuple[int, int]:
    """The ``(layer, head)`` to show first: the head of the strongest link that
    :func:`~handformer.viz.data.summarize` reports over all layers.

    Args:
        attentions: anything :func:`handformer.viz.data.as_attention_array` accepts: e.g. a
            model output's ``.attentions`` (one ``(B, H, L, L)`` tensor per layer).
        tokens: one label per position.
        special: per position, True for special tokens (default: labels like ``[CLS]``).
        words: per position, its word index (default: its position).
        unknown: per position, True for the model's unknown token (left out like special
            tokens: a link between two ``[UNK]`` says nothing).
        layer: a layer fixed by the caller (the head is chosen within it).
        head: a head fixed by the caller.
        include_sink: count links to and from the first position (the attention sink, left
            out by default).

    Returns:
        ``(layer, head)``.
    """
    # N x (H, L, L) for a sequence of layers, else one (N, H, L, L) array: x[n] is layer n
    x = as_attention_layers(attentions)
    N, (H, L, _) = len(x), x[0].shape
    if layer is not None and head is not None:
        return layer, head
    skip = left_out(tokens, special, unknown)
    # N x (H, L, L), or N x (1, L, L) for a fixed head: summarize reads a list as one entry
    # per layer
    layers = list(x) if head is None else [a[head:head + 1] for a in x]
    for distance in (2, 1):
        best = max((s for s in summarize(layers, tokens, special=skip, words=words,
                                         min_distance=distance, include_sink=include_sink)
                    if s.link is not None and (layer is None or s.layer == layer)),
                   key=lambda s: s.link[3], default=None)
        if best is not None:
            return (best.layer if layer is None else layer,
                    best.link[0] if head is None else head)
    # Nothing ordinary to link: the strongest weight between two different positions,
    # leaving out each token's own position and, unless include_sink, the first key.
    best_weight, best_at = -1.0, (0, 0)
    for n in range(N) if layer is None else (layer,):
        links = x[n].copy()  # (H, L, L)
        if not include_sink:
            links[..., 0] = 0.0
        links[:, np.arange(L), np.arange(L)] = 0.0
        per_head = links.reshape(H, -1).max(-1)  # (H,)
        for h in range(H) if head is None else (head,):
            if per_head[h] > best_weight:
                best_weight, best_at = float(per_head[h]), (n, h)
    return best_at
