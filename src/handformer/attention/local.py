"""Local (sliding-window) attention, computed in cache-sized blocks.

Pattern (positions aligned bottom-right: query ``i`` sits at key position
``p = i + L_k - L_q``): query ``i`` may attend key ``j`` iff ``|p - j| <= window_size // 2``,
and ``j <= p`` when ``causal``; a ``mask`` restricts it further. ``window_size`` is odd (the
query's own key plus ``window_size // 2`` on each side; an even size is refused). Softmax
attention with scale ``1/sqrt(D)`` unless ``scale`` is given.
:func:`handformer.masks.window_mask` builds the same pattern densely.

Complexity: queries are processed in blocks of 128; each block attends only the
``128 + 2 * (window_size // 2)`` keys its band can reach, so time is
``O(L_q * (w + 128) * D)`` and the working memory beyond the output is one ``128 x (128 + w)``
tile per head, never ``L_q x L_k``. Small tiles matter on CPU: the tile stays in cache (one big
batched call over all blocks was 2-3x slower on these machines). Without a mask or weights,
each block is a single call of torch's fused attention kernel on its key window, masked by one
shared band template (matmul, softmax and matmul fused, no score tile written out); with a
mask, or ``need_weights=True``, each block is an explicit masked-softmax tile
(``handformer.attention._tiles``). The dense ``(..., L_q, L_k)`` weights are built only when
``need_weights=True``.

How it differs from the seed's ``local_attention`` (section 7 of the tutorial): the seed builds
a full ``L x L`` mask holding ``1`` inside the window and ``-1e9`` outside, then its attention
adds ``mask * -1e9``: every key *inside* the window gets ``-1e9`` and every key outside gets
``+1e18``, so the window is the one place a query does not look. It also allocates ``L x L``
scores, so it is never cheaper than full attention, and ignores ``L_q != L_k`` and causality.

With ``softcap`` (Gemma 2), each scaled score is capped to ``softcap * tanh(s / softcap)``
before masking; the blocks then take the explicit tile path (still ``O(L_q * w)``).

Shape letters: ``L_q`` queries, ``L_k`` keys, ``D`` head dim, ``D_v`` value dim, leading batch
dims ``...``.
"""

from __future__ import annotations

from torch import Tensor

from handformer.attention._tiles import as_2d_mask, band_partial, prepare, score_scale
from handformer.attention.functional import check_qkv
from handformer.attention.kinds import AttentionKind, check_no_dropout
from handformer.checks import check_softcap, check_window_size
from handformer.masks import check_mask, window_mask

__all__ = ["local_attention", "LocalAttention"]


def local_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *,
                    window_size: int, causal: bool = False, scale: float | None = None,
                    need_weights: bool = False, softcap: float | None = None
                    ) -> tuple[Tensor, Tensor | None]:
    """Sliding-window softmax attention: query at ``p`` sees keys ``|p - j| <= w // 2``.

    Args:
        q: queries ``(..., L_q, D)``.
        k: keys ``(..., L_k, D)``.
        v: values ``(..., L_k, D_v)``.
        mask: bool (True = may attend) or float (additive bias) mask broadcastable to
            ``(..., L_q, L_k)``; it restricts the window further.
        window_size: odd ``w >= 1`` (keyword-only): a query sees its own position and
            ``w // 2`` keys on each side, only the left side when causal. An even ``w`` is
            refused: it would act as ``w + 1``.
        causal: also require ``j <= p`` (bottom-right aligned).
        scale: score scale (a positive number); None means ``1 / sqrt(D)``.
        need_weights: also return the dense ``(..., L_q, L_k)`` weights (zeros outside the
            window); this costs ``O(L_q * L_k)`` memory.
        softcap: cap each scaled score to ``softcap * tanh(s / softcap)`` before the mask
            (Gemma 2's attention-logit soft-cap; None: no cap). The blocks then take the
            explicit tile path, still ``O(L_q * w)``.

    Returns:
        ``(out, weights)``: ``out`` is ``(..., L_q, D_v)`` in the input dtype; rows with no
        allowed key are zero. ``weights`` is None unless ``need_weights``.

    Raises:
        ValueError: for a ``window_size`` that is not an odd positive integer, a ``scale``
            or ``softcap`` that is not a positive finite number, mismatched shapes or a mask
            that does not broadcast.
        TypeError: for non-floating inputs, a mask that is neither bool nor floating, or no
            ``window_size`` keyword (e.g. the window given by position, in ``mask``'s place).
    """
    check_qkv(q, k, v)
    check_window_size(window_size)
    softcap = check_softcap(softcap)
    scale = score_scale(scale, q.shape[-1])
    L_q, L_k = q.shape[-2], k.shape[-2]
    if mask is not None:
        check_mask(mask, (*q.shape[:-2], L_q, L_k))
    half = window_size // 2
    qs, kc, vc = prepare(q, k, v)  # unscaled: the scale goes into the kernel
    part = band_partial(qs, kc, vc, pos_offset=L_k - L_q, lo=-half, hi=0 if causal else half,
                        mask=as_2d_mask(mask), need_weights=need_weights, scale=scale,
                        softcap=softcap)
    weights = part.weights.to(q.dtype) if part.weights is not None else None
    return part.out.to(v.dtype), weights


class LocalAttention(AttentionKind):
    """Sliding-window attention as an attention kind (see :func:`local_attention`).

    Args:
        window_size: odd ``w >= 1``; a query sees the keys within ``w // 2`` positions.
        causal: always causal (a decoder's sliding-window layer: query ``p`` sees keys
            ``p - w // 2 .. p``), whatever ``causal`` a call passes; False (the default)
            leaves it to each call. A Hugging Face ``sliding_window = W`` (query ``i`` sees
            ``i - W < j <= i``) is ``LocalAttention(2 * W - 1, causal=True)``.
        softcap: attention-logit soft-cap (see :func:`local_attention`); None: none.

    Raises:
        ValueError: if ``window_size`` is not an odd positive integer, ``causal`` not a bool,
            or ``softcap`` not None or a positive finite number.
    """

    supports_dropout = False

    def __init__(self, window_size: int, *, causal: bool = False,
                 softcap: float | None = None) -> None:
        super().__init__()
        self.window_size = check_window_size(window_size)
        if not isinstance(causal, bool):
            raise ValueError(f"causal must be True or False, got {causal!r}")
        self.causal = causal
        self.softcap = check_softcap(softcap)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *,
                causal: bool = False, need_weights: bool = False, dropout_p: float = 0.0,
                scale: float | None = None) -> tuple[Tensor, Tensor | None]:
        """See :func:`local_attention`; ``dropout_p`` must be 0 (ValueError otherwise)."""
        check_no_dropout(self, dropout_p)
        return local_attention(q, k, v, mask, window_size=self.window_size,
                               causal=causal or self.causal, scale=scale,
                               need_weights=need_weights, softcap=self.softcap)

    def pattern(self, L_q: int, L_k: int, *, causal: bool = False) -> Tensor:
        """The dense bool ``(L_q, L_k)`` window pattern (:func:`handformer.masks.window_mask`)."""
        return window_mask(L_q, L_k, self.window_size, causal=causal or self.causal)

    def extra_repr(self) -> str:
        extra = f", causal={self.causal}" if self.causal else ""
        extra += "" if self.softcap is None else f", softcap={self.softcap}"
        return f"window_size={self.window_size}{extra}"
