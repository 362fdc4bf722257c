"""Head detectors: how much of each head's attention falls on a pattern (TransformerLens'
``detect_head``, "mul" score).

For one sequence, one head's score is the attention mass on the detection pattern over its
total attention mass, over the whole sequence::

    score = sum(A * P) / sum(A)        A: the head's (L, L) pattern, P: 0/1 detection pattern

(``exclude_bos`` zeroes ``A``'s first column, ``exclude_current_token`` its diagonal, in both
sums). Several sequences give the mean of their scores. The patterns:

* ``"previous_token"``: query ``i`` on key ``i - 1``;
* ``"duplicate_token"``: query ``i`` on earlier keys ``j < i`` holding the same token;
* ``"induction"``: query ``i`` on key ``j + 1`` where ``j < i`` holds the same token as ``i``
  (the token that followed the earlier occurrence), ``j + 1 <= i``;
* ``"bos"``: every query on key 0 (an attention sink);
* a custom ``(L, L)`` 0/1 tensor.

A query with no target (the first half of a repeated sequence has none for induction) keeps
its attention in the denominator, as TransformerLens does: a perfect induction head on a
sequence repeated once scores about 0.5. :func:`perfect_score` gives that ceiling for a
sequence (the share of queries that have a target).

This is the one definition of the scores in handformer: :func:`detect_heads` runs the model
and scores its cached patterns; :func:`detection_scores` scores patterns you already have. The
``handformer serve`` page's head grid calls it on its probe's attention, so a number on the
page is ``detect_heads(model, probe, kind)``'s. (The page once showed another score, the mean
attention on the target over the queries that have one: 1.0 for a perfect induction head, not
0.5. TransformerLens' score is the field's reference, so it is the one kept; on one sequence
of a causal model the two differ by a monotone rescaling for previous-token and first-token
heads, and nearly so for induction, so they rank heads alike.)

Shape letters: ``N`` layers, ``H`` heads, ``B`` batch, ``L`` length.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from handformer.inspect.points import attention_layers
from handformer.inspect.run import run_with_cache
from handformer.inspect.shares import my_share, progress_bar, reduce_sum

__all__ = ["detect_heads", "detection_scores", "detection_pattern", "perfect_score",
           "KINDS"]

KINDS = ("previous_token", "duplicate_token", "induction", "bos")


def detection_pattern(tokens: Tensor, kind: str) -> Tensor:
    """The 0/1 ``(L, L)`` detection pattern of one sequence ``(L,)`` (float).

    Args:
        tokens: the token ids ``(L,)`` of one sequence.
        kind: one of :data:`KINDS` (``"previous_token"``, ``"duplicate_token"``,
            ``"induction"``, ``"bos"``).

    Raises:
        ValueError: for an unknown kind.
    """
    L = tokens.shape[-1]
    i = torch.arange(L, device=tokens.device)
    if kind == "previous_token":
        return (i[:, None] - 1 == i[None, :]).float()
    if kind == "bos":
        return (i[None, :] == 0).expand(L, L).float()
    same = tokens[:, None] == tokens[None, :]  # (L, L): key j holds query i's token
    duplicate = same & (i[None, :] < i[:, None])  # (L, L): an earlier occurrence
    if kind == "duplicate_token":
        return duplicate.float()
    if kind == "induction":
        target = torch.zeros(L, L, dtype=torch.bool, device=tokens.device)
        target[:, 1:] = duplicate[:, :-1]  # key j + 1 after an earlier occurrence j
        return (target & (i[None, :] <= i[:, None])).float()
    raise ValueError(f"kind must be one of {KINDS} or an (L, L) tensor, got {kind!r}")


def _check_kind(kind: object) -> None:
    if not isinstance(kind, Tensor) and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS} or an (L, L) tensor, got {kind!r}")


def _target(tokens: Tensor, kind: str | Tensor) -> Tensor:
    """The detection pattern ``(L, L)`` of one sequence: named, or a custom one checked."""
    if isinstance(kind, str):
        return detection_pattern(tokens, kind)
    L = tokens.shape[-1]
    if kind.dim() != 2 or tuple(kind.shape) != (L, L):
        raise ValueError(f"a custom detection pattern must be (L, L) for sequences of one "
                         f"length L; got pattern {tuple(kind.shape)} for lengths [{L}]")
    return kind


def perfect_score(tokens: Tensor, kind: str | Tensor) -> float:
    """The score of a perfect head on one sequence ``(L,)`` (no exclusions): the share of
    queries whose detection-pattern row is not empty (``L_with_target / L``).

    Args:
        tokens: the token ids ``(L,)`` of one sequence.
        kind: one of :data:`KINDS`, or a custom ``(L, L)`` pattern.

    Raises:
        ValueError: for an unknown kind or a custom pattern of the wrong shape.
    """
    _check_kind(kind)
    tokens = torch.as_tensor(tokens)
    return float(_target(tokens, kind).bool().any(-1).double().mean())


def detection_scores(patterns: Tensor, tokens: Tensor, kind: str | Tensor, *,
                     exclude_bos: bool = False, exclude_current_token: bool = False) -> Tensor:
    """The "mul" scores of attention patterns you already have, for one sequence.

    ``detect_heads`` is this on the model's cached ``hook_pattern`` s, averaged over the
    sequences.

    Args:
        patterns: ``(..., H, L, L)`` attention weights on ``tokens`` (e.g. ``(N, H, L, L)``,
            every layer's).
        tokens: ``(L,)`` the sequence's token ids.
        kind: as for :func:`detect_heads`.
        exclude_bos: leave key 0 out of both sums.
        exclude_current_token: leave the diagonal out of both sums.

    Returns:
        ``(..., H)`` float64 scores in ``[0, 1]``, on ``patterns``' device.

    Raises:
        ValueError: for an unknown kind, a custom pattern or ``patterns`` of the wrong shape.
    """
    _check_kind(kind)
    tokens = torch.as_tensor(tokens)
    L = tokens.shape[-1]
    if tokens.dim() != 1 or patterns.dim() < 3 or tuple(patterns.shape[-2:]) != (L, L):
        raise ValueError(f"patterns must be (..., H, L, L) for tokens (L,); got patterns "
                         f"{tuple(patterns.shape)} for tokens {tuple(tokens.shape)}")
    target = _target(tokens.to(patterns.device), kind).to(patterns.device)
    return _score(patterns, target, exclude_bos, exclude_current_token)


def _sequences(input_ids: object) -> list[Tensor]:
    """The sequences ``(L,)`` of a ``(B, L)`` / ``(L,)`` tensor or a list of them."""
    if isinstance(input_ids, Tensor):
        if input_ids.dim() == 1:
            return [input_ids]
        if input_ids.dim() == 2:
            return list(input_ids)
        raise ValueError(f"input_ids must be (B, L) or (L,), got shape "
                         f"{tuple(input_ids.shape)}")
    if isinstance(input_ids, Mapping):
        raise TypeError("input_ids must be token ids (a tensor or a list of sequences), not a "
                        "tokenizer's output: pass enc['input_ids'] of unpadded sequences")
    if isinstance(input_ids, Sequence) and input_ids:
        seqs = []
        for s in input_ids:
            t = torch.as_tensor(s)
            seqs += [t] if t.dim() == 1 else list(t)
        return seqs
    raise TypeError(f"input_ids must be a tensor or a non-empty list of sequences, got "
                    f"{type(input_ids).__name__}")


def _score(patterns: Tensor, target: Tensor, exclude_bos: bool,
           exclude_current_token: bool) -> Tensor:
    """"mul" scores ``(..., H)`` of patterns ``(..., H, L, L)`` against a detection pattern
    broadcastable to them (``(L, L)``, or ``(B, 1, 1, L, L)`` for a batch): the one formula."""
    A = patterns.double()
    if exclude_bos:
        A = A.clone()
        A[..., 0] = 0.0
    if exclude_current_token:
        A = A * (1.0 - torch.eye(A.shape[-1], dtype=A.dtype, device=A.device))
    total = A.sum((-1, -2))
    return (A * target.to(A)).sum((-1, -2)) / total.clamp_min(1e-30)


def detect_heads(model: nn.Module, input_ids: object, kind: str | Tensor, *,
                 exclude_bos: bool = False, exclude_current_token: bool = False,
                 batch_size: int = 8, progress: bool | None = None) -> Tensor:
    """Every head's "mul" score for a detection pattern, averaged over the sequences.

    Sequences of the same length run batched (``batch_size`` per forward); under ``torchrun``
    each rank scores its share and the sums are reduced (see
    :mod:`handformer.inspect.shares`).

    Args:
        model: a causal LM (or any handformer model with ``blocks.{i}.attn.hook_pattern``).
        input_ids: ``(B, L)`` / ``(L,)`` token ids, or a list of sequences (any lengths).
        kind: ``"previous_token"``, ``"duplicate_token"``, ``"induction"``, ``"bos"``, or a
            custom ``(L, L)`` detection pattern (every sequence of length ``L``).
        exclude_bos: leave key 0 out of both sums.
        exclude_current_token: leave the diagonal out of both sums.
        batch_size: sequences per forward.
        progress: a progress bar (default: on a terminal).

    Returns:
        ``(num_layers, num_heads)`` float64 scores in ``[0, 1]``.

    Raises:
        ValueError: for an unknown kind, a custom pattern of the wrong shape, a bad
            ``batch_size``.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    _check_kind(kind)
    seqs = _sequences(input_ids)
    if isinstance(kind, Tensor):
        lengths = {s.shape[0] for s in seqs}
        L = next(iter(lengths))
        if kind.dim() != 2 or tuple(kind.shape) != (L, L) or len(lengths) != 1:
            raise ValueError(f"a custom detection pattern must be (L, L) for sequences of "
                             f"one length L; got pattern {tuple(kind.shape)} for lengths "
                             f"{sorted(lengths)}")
    layers = attention_layers(model)
    N, H = len(layers), layers[0].num_heads
    device = next(model.parameters()).device
    total = torch.zeros(N, H, dtype=torch.float64)
    mine = my_share(seqs)
    by_length: dict[int, list[Tensor]] = {}
    for _, s in mine:
        by_length.setdefault(s.shape[0], []).append(s)
    names = [f"blocks.{i}.attn.hook_pattern" for i in range(N)]
    desc = f"detecting {kind if isinstance(kind, str) else 'pattern'} heads"
    with torch.no_grad(), progress_bar(len(mine), desc, progress) as bar:
        for group in by_length.values():
            for start in range(0, len(group), batch_size):
                chunk = torch.stack(group[start:start + batch_size]).to(device)  # (B, L)
                _, cache = run_with_cache(model, chunk, names=names)
                patterns = torch.stack([cache[n] for n in names], 1)  # (B, N, H, L, L)
                targets = torch.stack([_target(s, kind) for s in chunk])  # (B, L, L)
                scores = _score(patterns, targets[:, None, None].to(patterns.device),
                                exclude_bos, exclude_current_token)  # (B, N, H)
                total += scores.sum(0).cpu()
                bar.update(chunk.shape[0])
    return reduce_sum(total) / len(seqs)
