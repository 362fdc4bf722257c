"""Attention kinds: small modules that share one call signature.

Every kind is called as::

    kind(q, k, v, mask=None, *, causal=False, need_weights=False, dropout_p=0.0, scale=None)
        -> (out, weights | None)

with ``q: (..., L_q, D)``, ``k: (..., L_k, D)``, ``v: (..., L_k, D_v)``, exactly like the
functions (:func:`~handformer.attention.functional.scaled_dot_product_attention`,
``local_attention``, ``strided_attention``, ``linear_attention``), whose pattern parameters
(``window_size=``, ``stride=``, ...) are keyword-only and held by the kind instead.
``scale=None`` is each kind's default (``1 / sqrt(D)`` for the softmax kinds, 1 for linear
attention, where it multiplies ``q`` before the feature map). ``MultiHeadAttention``
and the layers take any of them through ``attention=``. With ``need_weights=True`` every kind
returns its effective dense ``(..., L_q, L_k)`` matrix: that is what the visualiser draws.
"""

from __future__ import annotations

from torch import Tensor, nn

from handformer.attention.functional import (
    masked_scores,
    masked_softmax,
    scaled_dot_product_attention,
)
from handformer.masks import causal_mask

__all__ = ["AttentionKind", "FullAttention", "check_no_dropout"]


def check_no_dropout(kind: AttentionKind, dropout_p: float) -> None:
    """Raise ``ValueError`` if dropout is asked of a kind that does not apply it."""
    if dropout_p != 0.0:
        raise ValueError(
            f"dropout_p={dropout_p}: {type(kind).__name__} does not apply dropout to its "
            "weights; use dropout_p=0.0"
        )


class AttentionKind(nn.Module):
    """Base class of the attention kinds (no parameters; one call signature).

    Subclasses implement :meth:`forward`. ``supports_dropout`` says whether the kind applies
    dropout to its attention weights; :meth:`pattern` returns the boolean ``(L_q, L_k)`` pattern
    of keys each query may reach (None = all keys), for visualisation and tests.
    """

    supports_dropout: bool = False

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *,
                causal: bool = False, need_weights: bool = False, dropout_p: float = 0.0,
                scale: float | None = None) -> tuple[Tensor, Tensor | None]:
        """Attend from ``q`` to ``k``/``v`` with this kind's pattern.

        Args:
            q: queries ``(..., L_q, D)``.
            k: keys ``(..., L_k, D)``.
            v: values ``(..., L_k, D_v)``.
            mask: bool (True = may attend) or float (additive bias) mask broadcastable to
                ``(..., L_q, L_k)``, positional or by keyword.
            causal: block keys after the query's position (bottom-right aligned).
            need_weights: also return the effective dense ``(..., L_q, L_k)`` weights.
            dropout_p: dropout on the weights; only kinds with ``supports_dropout`` accept
                a value above 0.
            scale: the kind's score scale; None is its default.

        Returns:
            ``(out, weights)``: ``out`` ``(..., L_q, D_v)``; ``weights`` or None.

        Raises:
            ValueError / TypeError: for the bad inputs each kind documents.
        """
        raise NotImplementedError

    def pattern(self, L_q: int, L_k: int, *, causal: bool = False) -> Tensor | None:
        """Boolean ``(L_q, L_k)`` pattern of allowed keys, or None when every key is allowed."""
        return None

    # The explicit path: what MultiHeadAttention runs when a hook reads or replaces the
    # scores or the pattern. ``normalize(scores(q, k)) @ v`` is the kind's output, and
    # ``normalize(scores(q, k))`` is the matrix ``need_weights=True`` returns.

    def scores(self, q: Tensor, k: Tensor, *, causal: bool = False,
               mask: Tensor | None = None, scale: float | None = None) -> Tensor:
        """Dense pre-normalisation scores ``(..., L_q, L_k)``.

        For softmax kinds: ``q k^T * scale`` plus a float mask, ``-inf`` outside the kind's
        pattern and where a bool mask is False.
        """
        L_q, L_k = q.shape[-2], k.shape[-2]
        return masked_scores(q, k, mask, allowed=self.pattern(L_q, L_k, causal=causal),
                             scale=scale)

    def normalize(self, scores: Tensor) -> Tensor:
        """Scores -> attention weights (softmax; rows with no allowed key are 0)."""
        return masked_softmax(scores)


class FullAttention(AttentionKind):
    """Ordinary (dense) softmax attention: every query may attend every key.

    Cost O(L_q * L_k * D) time; O(L_q * L_k) memory only when weights are asked for
    (otherwise torch's fused kernel runs).
    """

    supports_dropout = True

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *,
                causal: bool = False, need_weights: bool = False, dropout_p: float = 0.0,
                scale: float | None = None) -> tuple[Tensor, Tensor | None]:
        """See :func:`handformer.scaled_dot_product_attention`."""
        return scaled_dot_product_attention(q, k, v, mask, causal=causal, scale=scale,
                                            dropout_p=dropout_p, need_weights=need_weights)

    def pattern(self, L_q: int, L_k: int, *, causal: bool = False) -> Tensor | None:
        return causal_mask(L_q, L_k) if causal else None
