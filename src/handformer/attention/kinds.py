"""Attention kinds: small modules that share one call signature.

Every kind is called as::

    kind(q, k, v, mask=None, *, causal=False, need_weights=False, dropout_p=0.0, scale=None)
        -> (out, weights | None)

(:class:`FullAttention` also takes ``enable_gqa=True``: keys and values with fewer heads than
the queries, grouped-query attention), with ``q: (..., L_q, D)``, ``k: (..., L_k, D)``,
``v: (..., L_k, D_v)``, exactly like the functions
(:func:`~handformer.attention.functional.scaled_dot_product_attention`, ``local_attention``,
``strided_attention``, ``linear_attention``), whose pattern parameters
(``window_size=``, ``stride=``, ...) are keyword-only and held by the kind instead.
``scale=None`` is each kind's default (``1 / sqrt(D)`` for the softmax kinds, 1 for linear
attention, where it multiplies ``q`` before the feature map). ``MultiHeadAttention``
and the layers take any of them through ``attention=``. With ``need_weights=True`` every kind
returns its effective dense ``(..., L_q, L_k)`` matrix: that is what the visualiser draws.

The softmax kinds (full, local) take ``softcap=`` at construction: attention-logit
soft-capping ``softcap * tanh(scores / softcap)`` (Gemma 2), applied to the scaled scores
before any mask; it is part of the kind's scores (:meth:`AttentionKind.scores`, what
``hook_attn_scores`` shows).
"""

from __future__ import annotations

from torch import Tensor, nn

from handformer.attention.functional import (
    kv_groups,
    masked_scores,
    masked_softmax,
    repeat_kv,
    scaled_dot_product_attention,
)
from handformer.checks import check_softcap
from handformer.masks import causal_mask

__all__ = ["AttentionKind", "FullAttention", "check_no_dropout", "attend_kind"]


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
    supports_gqa: bool = False  # takes keys/values with fewer heads (``enable_gqa=True``)
    softcap: float | None = None  # the softmax kinds' attention-logit soft-cap

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

        For softmax kinds: ``cap(q k^T * scale)`` plus a float mask, ``-inf`` outside the
        kind's pattern and where a bool mask is False (``cap`` the kind's soft-cap, if any).
        """
        L_q, L_k = q.shape[-2], k.shape[-2]
        return masked_scores(q, k, mask, allowed=self.pattern(L_q, L_k, causal=causal),
                             scale=scale, softcap=self.softcap)

    def normalize(self, scores: Tensor) -> Tensor:
        """Scores -> attention weights (softmax; rows with no allowed key are 0)."""
        return masked_softmax(scores)


class FullAttention(AttentionKind):
    """Ordinary (dense) softmax attention: every query may attend every key.

    Cost O(L_q * L_k * D) time; O(L_q * L_k) memory only when weights are asked for
    or the scores are soft-capped (otherwise torch's fused kernel runs).

    Args:
        softcap: attention-logit soft-cap ``softcap * tanh(s / softcap)`` of the scaled
            scores, before masking (None: none).

    Raises:
        ValueError: for a ``softcap`` that is not None or a positive finite number.
    """

    supports_dropout = True
    supports_gqa = True

    def __init__(self, *, softcap: float | None = None) -> None:
        super().__init__()
        self.softcap = check_softcap(softcap)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *,
                causal: bool = False, need_weights: bool = False, dropout_p: float = 0.0,
                scale: float | None = None, enable_gqa: bool = False
                ) -> tuple[Tensor, Tensor | None]:
        """See :func:`handformer.scaled_dot_product_attention`."""
        return scaled_dot_product_attention(q, k, v, mask, causal=causal, scale=scale,
                                            dropout_p=dropout_p, need_weights=need_weights,
                                            softcap=self.softcap, enable_gqa=enable_gqa)

    def pattern(self, L_q: int, L_k: int, *, causal: bool = False) -> Tensor | None:
        return causal_mask(L_q, L_k) if causal else None

    def extra_repr(self) -> str:
        return "" if self.softcap is None else f"softcap={self.softcap}"


def attend_kind(attention: AttentionKind, q: Tensor, k: Tensor, v: Tensor,
                mask: Tensor | None, **options: object) -> tuple[Tensor, Tensor | None]:
    """Call an attention kind with ``H_kv`` key/value heads (dim 1) for ``H`` query heads.

    A kind that takes grouped keys (``supports_gqa``) gets them as they are with
    ``enable_gqa=True``; any other gets them repeated to the query heads (a copy).
    """
    groups = kv_groups(q, k)
    if groups == 1:
        return attention(q, k, v, mask=mask, **options)  # mask by keyword, as custom kinds expect
    if attention.supports_gqa:
        return attention(q, k, v, mask=mask, enable_gqa=True, **options)
    return attention(q, repeat_kv(k, groups), repeat_kv(v, groups), mask=mask, **options)
