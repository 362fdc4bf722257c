"""QK attribution: why a head attends where it does, in features; and a head's factored OV/QK.

In the prompt's replacement model (:mod:`~handformer.features.replacement`: norm scales,
QK-norm scales and patterns frozen) a head's query vector at position ``q`` is linear in the
sources (features, error nodes, token embeddings) plus a constant: ``ln1`` with a fixed
divisor, ``W_Q`` and ``b_Q``, the QK-norm with a fixed divisor and the rotation of RoPE at a
fixed position are all linear. The same holds for the key at position ``k``. So the head's
score (``scale · q·k``, before any soft-cap) splits exactly into a sum over pairs::

    score = Σ_{s, s'} scale · Q_s · K_s'          (Q_s: source s's share of the query)

with the constant terms as one more source (``"const"``) on each side.
:func:`qk_attribution` returns that ``(S+1) × (S+1)`` table.

:func:`head_ov` and :func:`head_qk` are TransformerLens' ``OV`` and ``QK``
(``W_V[h] @ W_O[h]`` and ``W_Q[h] @ W_K[h]ᵀ``, ``(E, E)``, as a :class:`FactoredMatrix` with
its singular values and eigenvalues); with RoPE, ``QK`` at a relative ``offset`` (key position
minus query position): ``W_Q[h] R(offset) W_K[h]ᵀ``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from handformer.features.replacement import ReplacementModel

__all__ = ["QKAttribution", "qk_attribution", "FactoredMatrix", "head_ov", "head_qk"]


@dataclass
class QKAttribution:
    """A head's score at one (query, key) pair, split over pairs of sources.

    Attributes:
        labels: the ``S + 1`` sources (graph labels, then ``"const"``).
        query: ``(S + 1, D)`` each source's share of the (rotated, normed) query vector.
        key: ``(S + 1, D)`` each source's share of the key vector.
        pairs: ``(S + 1, S + 1)`` ``scale · query[i] · key[j]``: sums to ``score``.
        score: the head's score before any soft-cap (``scale · q · k``).
    """

    labels: list[str]
    query: Tensor
    key: Tensor
    pairs: Tensor
    score: float

    def top(self, n: int = 10) -> list[tuple[str, str, float]]:
        """The ``n`` largest pairs by absolute value: ``(query source, key source, share)``."""
        flat = self.pairs.flatten()
        order = flat.abs().argsort(descending=True)[:n]
        S = self.pairs.shape[1]
        return [(self.labels[int(i) // S], self.labels[int(i) % S], float(flat[i]))
                for i in order]


def qk_attribution(model: nn.Module, transcoders: Any, ids: Tensor, *, layer: int, head: int,
                   query_pos: int, key_pos: int) -> QKAttribution:
    """Split head ``head`` of ``layer``'s score at ``(query_pos, key_pos)`` over source pairs.

    Args:
        model: a handformer ``CausalLM`` in eval mode.
        transcoders: one transcoder per layer (see :func:`attribution_graph`).
        ids: ``(L,)`` or ``(1, L)`` the prompt.
        layer, head: the attention head.
        query_pos, key_pos: positions, ``key_pos <= query_pos``.

    Returns:
        A :class:`QKAttribution`; its sources are the features and errors of earlier layers
        and the token embeddings.

    Raises:
        ValueError: for a layer, head or position out of range; a model with QK-norm but no
            RoPE (its normed query is not exposed at a hook point).
    """
    rep = ReplacementModel(model, transcoders, ids)
    L = rep.ids.shape[0]
    if not isinstance(layer, int) or not 0 <= layer < rep.n_layers:
        raise ValueError(f"layer must be in 0..{rep.n_layers - 1}, got {layer!r}")
    attn = rep.layers[layer].attn
    if not isinstance(head, int) or not 0 <= head < attn.num_heads:
        raise ValueError(f"head must be in 0..{attn.num_heads - 1}, got {head!r}")
    if not (isinstance(query_pos, int) and isinstance(key_pos, int)
            and 0 <= key_pos <= query_pos < L):
        raise ValueError(f"need 0 <= key_pos <= query_pos < {L}, got query_pos={query_pos!r}, "
                         f"key_pos={key_pos!r}")
    if attn.rotary is None and attn.q_norm is not None:
        raise ValueError("qk_attribution: QK-norm without RoPE is not supported (the normed "
                         "query has no hook point)")
    qn, kn = ("hook_rot_q", "hook_rot_k") if attn.rotary is not None else ("hook_q", "hook_k")
    names = (f"blocks.{layer}.attn.{qn}", f"blocks.{layer}.attn.{kn}")
    kv_head = head // (attn.num_heads // attn.num_kv_heads)
    scale = attn.scale if attn.scale is not None else 1 / math.sqrt(attn.head_dim)

    def vectors(out: Any) -> Tensor:
        q = out.captured[names[0]][0, head, query_pos]  # (D,)
        k = out.captured[names[1]][0, kv_head, key_pos]  # (D,)
        return torch.cat([q, k])  # (2D,)

    earlier = [i for i in range(layer) if rep.acts[i] is not None]
    active = {i: rep.acts[i][0].nonzero() for i in earlier}  # (n_i, 2) position, feature
    embed = rep.embed.clone().requires_grad_(True)
    errors = rep.errors.clone().requires_grad_(True)
    acts = [None if a is None else a.clone().requires_grad_(i in active)
            for i, a in enumerate(rep.acts)]
    y = vectors(rep.run(embed, acts, errors, capture=names))
    leaves = [embed, errors] + [acts[i] for i in earlier]
    seeds = torch.eye(y.shape[0], dtype=y.dtype)
    grads = torch.autograd.grad(y, leaves, grad_outputs=seeds, is_grads_batched=True,
                                allow_unused=True)
    shares, labels = [], []
    for n, i in enumerate(earlier):
        a, g = active[i], grads[2 + n]  # g: (2D, 1, L, F)
        shares.append((g[:, 0, a[:, 0], a[:, 1]] * rep.acts[i][0][tuple(a.T)]).T)  # (n_i, 2D)
        labels += [f"L{i} F{f} @{p}" for p, f in a.tolist()]
    e = (grads[1] * rep.errors).sum(-1)[:, :layer, 0]  # (2D, layer, L)
    shares.append(e.flatten(1).T)  # (layer·L, 2D)
    labels += [f"err L{i} @{p}" for i in range(layer) for p in range(L)]
    shares.append((grads[0] * rep.embed).sum(-1)[:, 0].T)  # (L, 2D)
    labels += [f"emb {int(t)} @{p}" for p, t in enumerate(rep.ids)]
    with torch.no_grad():
        zero = rep.run(torch.zeros_like(rep.embed),
                       [None if a is None else torch.zeros_like(a) for a in rep.acts],
                       torch.zeros_like(rep.errors), capture=names)
        shares.append(vectors(zero)[None])  # (1, 2D) the constant
    labels.append("const")
    table = torch.cat([s.detach().to(y.dtype) for s in shares])  # (S + 1, 2D)
    D = y.shape[0] // 2
    query, key = table[:, :D], table[:, D:]
    pairs = scale * query @ key.T  # (S + 1, S + 1)
    score = float(scale * (y[:D] @ y[D:]).detach())
    return QKAttribution(labels, query, key, pairs, score)


class FactoredMatrix:
    """``A @ B`` kept as its two factors (TransformerLens' ``FactoredMatrix``, the few parts
    used here): ``A (E, D)``, ``B (D, E)``.

    Args:
        A: ``(m, r)``.
        B: ``(r, n)``.

    Raises:
        ValueError: when the inner sizes differ.
    """

    def __init__(self, A: Tensor, B: Tensor) -> None:
        if A.dim() != 2 or B.dim() != 2 or A.shape[1] != B.shape[0]:
            raise ValueError(f"FactoredMatrix needs A (m, r) and B (r, n), got "
                             f"{tuple(A.shape)} and {tuple(B.shape)}")
        self.A, self.B = A, B

    @property
    def AB(self) -> Tensor:  # noqa: N802 - TransformerLens' name
        """The product ``(m, n)``."""
        return self.A @ self.B

    def svd(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(U (m, r), S (r,), V (n, r))`` with ``AB = U diag(S) Vᵀ``, from the factors only
        (QR of each, then the SVD of an ``r × r`` matrix)."""
        Qa, Ra = torch.linalg.qr(self.A)  # (m, r), (r, r)
        Qb, Rb = torch.linalg.qr(self.B.T)  # (n, r), (r, r)
        U, S, Vh = torch.linalg.svd(Ra @ Rb.T)  # (r, r)
        return Qa @ U, S, Qb @ Vh.T

    @property
    def S(self) -> Tensor:  # noqa: N802
        """The singular values ``(r,)``, largest first."""
        return self.svd()[1]

    @property
    def eigenvalues(self) -> Tensor:
        """The non-trivial eigenvalues of a square ``AB``: those of ``BA`` ``(r,)``, complex."""
        if self.A.shape[0] != self.B.shape[1]:
            raise ValueError("eigenvalues need a square product")
        return torch.linalg.eigvals(self.B @ self.A)


def _head(model: nn.Module, layer: int, head: int) -> nn.Module:
    layers = model.blocks
    if not isinstance(layer, int) or not 0 <= layer < len(layers):
        raise ValueError(f"layer must be in 0..{len(layers) - 1}, got {layer!r}")
    attn = layers[layer].attn
    if not isinstance(head, int) or not 0 <= head < attn.num_heads:
        raise ValueError(f"head must be in 0..{attn.num_heads - 1}, got {head!r}")
    return attn


def head_ov(model: nn.Module, layer: int, head: int) -> FactoredMatrix:
    """TransformerLens' ``OV`` of one head: ``W_V[h] @ W_O[h]`` ``(E, E)`` (GQA: the key/value
    head the query head shares).

    Args:
        model: a handformer model.
        layer: the block.
        head: the query head.

    Raises:
        ValueError: for a layer or head out of range.
    """
    attn = _head(model, layer, head)
    kv = head // (attn.num_heads // attn.num_kv_heads)
    return FactoredMatrix(attn.W_V[kv].detach(), attn.W_O[head].detach())


def head_qk(model: nn.Module, layer: int, head: int, *, offset: int | None = None
            ) -> FactoredMatrix:
    """TransformerLens' ``QK`` of one head: ``W_Q[h] @ W_K[h]ᵀ`` ``(E, E)``; with RoPE, at a
    relative ``offset`` (key position minus query position, ``<= 0``): ``W_Q R(offset) W_Kᵀ``.

    Args:
        model: a handformer model.
        layer: the block.
        head: the query head.
        offset: needed for a RoPE model (its QK depends on the distance); None otherwise.

    Raises:
        ValueError: for a layer or head out of range, a RoPE model without ``offset`` (or an
            offset without RoPE), a model with QK-norm (not linear in the weights alone).
    """
    attn = _head(model, layer, head)
    if attn.q_norm is not None:
        raise ValueError("head_qk: this head has QK-norm, so its QK is not a fixed matrix "
                         "(use qk_attribution on a prompt)")
    kv = head // (attn.num_heads // attn.num_kv_heads)
    W_Q, W_K = attn.W_Q[head].detach(), attn.W_K[kv].detach()  # (E, D) each
    if attn.rotary is None:
        if offset is not None:
            raise ValueError("offset is only for RoPE heads; this head has no rotary "
                             "embedding")
        return FactoredMatrix(W_Q, W_K.T)
    if not isinstance(offset, int):
        raise ValueError(f"offset (key position minus query position) is needed for a RoPE "
                         f"head, got {offset!r}")
    D = W_Q.shape[1]
    basis = torch.eye(D, dtype=W_Q.dtype)[None, :, None, :]  # (1, D, 1, D) rows e_i, one head each
    q_pos, k_pos = max(0, -offset), max(0, offset)
    Rq = attn.rotary.rotate(basis, torch.tensor([q_pos]))[0, :, 0]  # (D, D) row i: R_q e_i
    Rk = attn.rotary.rotate(basis, torch.tensor([k_pos]))[0, :, 0]  # (D, D)
    # score = (W_Qᵀx R_q)·(W_Kᵀy R_k): rows act on the right, so QK = W_Q Rq Rkᵀ W_Kᵀ
    return FactoredMatrix(W_Q @ Rq, Rk.T @ W_K.T)
