"""Attention data for the visualiser: accept what models return, validate, summarise, encode.

Every plotting and viewer function first turns its input into one float32 array of shape
``(N, H, L_q, L_k)`` with :func:`as_attention_array`, so they all accept the same things: one
head's ``(L_q, L_k)`` matrix, one layer's ``(H, L_q, L_k)`` or ``(B, H, L_q, L_k)`` weights, a
sequence of per-layer tensors (what ``Encoder(..., need_weights=True).attentions`` holds), or a
model output with an ``.attentions`` attribute.

Shape letters: ``N`` layers, ``H`` heads, ``B`` batch, ``L_q`` queries, ``L_k`` keys.
"""

from __future__ import annotations

import base64
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "as_attention_array",
    "as_attention_layers",
    "check_tokens",
    "as_pattern",
    "encode_weights",
    "quantize_weights",
    "LayerSummary",
    "summarize",
]

# Above this many bytes the quantised weights are deflate-compressed in the HTML (browsers
# inflate them with DecompressionStream); below it they are stored raw, readable everywhere.
RAW_LIMIT = 256 * 1024
# Budget for the encoded weights in one HTML file (the page itself adds about 40 kB).
MAX_BYTES = 9 * 1024 * 1024
# float32 values per quantisation block (1 MB): small enough to stay in a core's cache.
_BLOCK = 1 << 18


def _to_numpy(x: object, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float32).numpy()
    elif isinstance(x, np.ndarray):
        x = x.astype(np.float32, copy=False)
    else:
        raise TypeError(f"{name} must be a torch.Tensor or numpy array, got {type(x).__name__}")
    return x


def _drop_batch(x: np.ndarray, batch_index: int, name: str) -> np.ndarray:
    """``(B, H, L_q, L_k)`` -> ``(H, L_q, L_k)`` at ``batch_index``; smaller ranks unchanged."""
    if x.ndim == 4:
        if not -x.shape[0] <= batch_index < x.shape[0]:
            raise ValueError(f"batch_index={batch_index} is out of range for {name} with batch "
                             f"size {x.shape[0]} (shape {tuple(x.shape)})")
        return x[batch_index]
    return x


def as_attention_array(attentions: object, *, batch_index: int = 0) -> np.ndarray:
    """Normalise attention weights to one float32 array ``(N, H, L_q, L_k)``.

    Args:
        attentions: what :func:`as_attention_layers` accepts.
        batch_index: which batch element to take from ``(B, H, L_q, L_k)`` weights.

    Returns:
        float32 numpy array ``(N, H, L_q, L_k)``.

    Raises:
        TypeError, ValueError: as :func:`as_attention_layers`.
    """
    x = _normalise(attentions, batch_index)
    return np.stack(x) if isinstance(x, list) else x


def as_attention_layers(attentions: object, *, batch_index: int = 0,
                        check_finite: bool = True) -> np.ndarray | list[np.ndarray]:
    """Like :func:`as_attention_array`, without stacking per-layer inputs into one new array
    (at 512 tokens x 72 heads that copy is 76 MB): what the quantiser needs.

    Args:
        attentions: ``(L_q, L_k)`` (one head), ``(H, L_q, L_k)`` or ``(B, H, L_q, L_k)`` (one
            layer), a list/tuple of per-layer ``(B, H, L_q, L_k)`` or ``(H, L_q, L_k)``
            tensors, or an object with an ``.attentions`` attribute holding such a sequence
            (a handformer model output). Tensors or numpy arrays.
        batch_index: which batch element to take from ``(B, H, L_q, L_k)`` weights.
        check_finite: refuse NaN and infinities (two passes over the data); False for a
            caller that checks them anyway, as :func:`quantize_weights` does.

    Returns:
        A float32 ``(N, H, L_q, L_k)`` array, or for a sequence input a list of ``N``
        C-contiguous float32 ``(H, L_q, L_k)`` arrays; either way ``x[n]`` is layer ``n``.

    Raises:
        TypeError: for other input types.
        ValueError: for other ranks, layers of different shapes, empty input, or values that
            are not finite.
    """
    return _normalise(attentions, batch_index, check_finite)


def _normalise(attentions: object, batch_index: int, check_finite: bool = True
               ) -> np.ndarray | list[np.ndarray]:
    if hasattr(attentions, "attentions") and not isinstance(attentions, torch.Tensor | np.ndarray):
        attentions = attentions.attentions
        if attentions is None:
            raise ValueError("the model output holds no attentions; run the model with "
                             "need_weights=True")
    if isinstance(attentions, torch.Tensor | np.ndarray):
        x = _to_numpy(attentions, "attentions")
        if x.ndim == 2:  # (L_q, L_k)
            x = x[None, None]  # (1, 1, L_q, L_k)
        elif x.ndim in (3, 4):
            x = _drop_batch(x, batch_index, "attentions")[None]  # (1, H, L_q, L_k)
        else:
            raise ValueError(
                "attentions must be (L_q, L_k), (H, L_q, L_k), (B, H, L_q, L_k) or a sequence "
                f"of per-layer weights, got shape {tuple(x.shape)}"
            )
    elif isinstance(attentions, Sequence) and not isinstance(attentions, str):
        if len(attentions) == 0:
            raise ValueError("attentions is an empty sequence; expected one tensor per layer")
        layers = []
        for n, layer in enumerate(attentions):
            y = _drop_batch(_to_numpy(layer, f"attentions[{n}]"), batch_index, f"attentions[{n}]")
            if y.ndim != 3:
                raise ValueError(f"attentions[{n}] must be (B, H, L_q, L_k) or (H, L_q, L_k), "
                                 f"got shape {tuple(y.shape)}")
            if layers and y.shape != layers[0].shape:
                raise ValueError(f"attentions[{n}] has shape {tuple(y.shape)} but attentions[0] "
                                 f"has {tuple(layers[0].shape)}; all layers must match")
            layers.append(y)
        if layers[0].size == 0:
            raise ValueError(f"attentions is empty (shape {(len(layers), *layers[0].shape)})")
        for n, layer in enumerate(layers):  # min and max propagate NaN and show infinities
            if check_finite and not (np.isfinite(layer.min()) and np.isfinite(layer.max())):
                raise ValueError(f"attentions holds NaN or infinite values (layer {n})")
        return [np.ascontiguousarray(y, dtype=np.float32) for y in layers]  # N x (H, L_q, L_k)
    else:
        fields = sorted(n for n in dir(attentions)
                        if n.endswith("attentions") and not n.startswith("_"))
        hint = f"; pass one of its fields: {', '.join(fields)}" if fields else ""
        raise TypeError("attentions must be a tensor, an array, a sequence of per-layer tensors "
                        f"or a model output with .attentions, got {type(attentions).__name__}"
                        + hint)
    if x.size == 0:
        raise ValueError(f"attentions is empty (shape {tuple(x.shape)})")
    # min and max propagate NaN and show infinities: two passes, no L x L temporary
    if check_finite and not (np.isfinite(x.min()) and np.isfinite(x.max())):
        raise ValueError("attentions holds NaN or infinite values")
    return np.ascontiguousarray(x, dtype=np.float32)


def check_tokens(tokens: object, length: int, name: str = "tokens") -> list[str]:
    """Return ``tokens`` as a list of ``length`` strings, or raise.

    Raises:
        TypeError: if ``tokens`` is a string or holds non-strings.
        ValueError: if the count does not match ``length``.
    """
    if isinstance(tokens, str) or not isinstance(tokens, Sequence):
        raise TypeError(f"{name} must be a sequence of strings (one per position), got "
                        f"{type(tokens).__name__}")
    out = list(tokens)
    bad = [t for t in out if not isinstance(t, str)]
    if bad:
        raise TypeError(f"{name} must hold strings, found {type(bad[0]).__name__}")
    if len(out) != length:
        raise ValueError(f"{name} has {len(out)} entries but the attention has {length} "
                         f"positions on that axis")
    return out


def as_pattern(pattern: object, L_q: int, L_k: int) -> np.ndarray | None:
    """Return a boolean ``(L_q, L_k)`` array of allowed keys, or None.

    ``pattern`` may be None, a boolean tensor/array that broadcasts to ``(L_q, L_k)``, or an
    attention kind with a ``pattern(L_q, L_k)`` method (e.g. ``LocalAttention(3)``).

    Raises:
        TypeError: if the pattern is not boolean.
        ValueError: if it does not broadcast to ``(L_q, L_k)``.
    """
    if pattern is None:
        return None
    if hasattr(pattern, "pattern") and callable(pattern.pattern):
        pattern = pattern.pattern(L_q, L_k)
        if pattern is None:
            return None
    if isinstance(pattern, torch.Tensor):
        if pattern.dtype != torch.bool:
            raise TypeError(f"pattern must be boolean (True = may attend), got {pattern.dtype}")
        pattern = pattern.detach().cpu().numpy()
    pattern = np.asarray(pattern)
    if pattern.dtype != np.bool_:
        raise TypeError(f"pattern must be boolean (True = may attend), got {pattern.dtype}")
    try:
        return np.ascontiguousarray(np.broadcast_to(pattern, (L_q, L_k)))
    except ValueError:
        raise ValueError(f"pattern of shape {pattern.shape} does not broadcast to "
                         f"(L_q, L_k) = ({L_q}, {L_k})") from None


def quantize_weights(x: np.ndarray | Sequence[np.ndarray], levels: int = 255
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantise ``(N, H, L_q, L_k)`` weights to ``levels + 1`` values per head, 8 bits each.

    Each head is scaled to its own range ``[lo, hi]`` (``lo = min(0, min)``): ``q`` stands for
    ``lo + q / levels * (hi - lo)``, and ``q = rint((x - lo) * (levels / (hi - lo)))`` in
    float32 (a constant head uses a span of 1). The arithmetic runs in blocks of about a
    megabyte, so each block stays in cache while it is shifted, scaled, rounded and stored
    (at 512 tokens x 72 heads, twice as fast as whole-array passes).

    Args:
        x: float32 weights, all finite: one ``(N, H, L_q, L_k)`` array or ``N`` arrays
            ``(H, L_q, L_k)`` (see :func:`as_attention_layers`).
        levels: the largest code, 1..255.

    Returns:
        ``(q, lo, hi)``: uint8 ``(N, H, L_q, L_k)`` codes and float32 ``(N, H)`` ranges.

    Raises:
        ValueError: for other ranks, dtypes or shapes, an empty input, NaN or infinite
            values, or ``levels`` outside 1..255.
    """
    if isinstance(levels, bool) or not isinstance(levels, int) or not 1 <= levels <= 255:
        raise ValueError(f"levels must be an int in 1..255, got {levels!r}")
    layers = list(x)
    shape = layers[0].shape if layers else ()
    if (not layers or any(y.dtype != np.float32 or y.shape != shape for y in layers)
            or len(shape) != 3 or layers[0].size == 0):
        got = [f"{y.dtype} {tuple(y.shape)}" for y in layers[:2]]
        raise ValueError(f"x must be float32 (N, H, L_q, L_k) weights or N arrays (H, L_q, "
                         f"L_k) of one shape, not empty; got {len(layers)} layer(s): {got}")
    N, (H, L_q, L_k) = len(layers), shape
    cols = L_q * L_k
    if N * H * cols <= _BLOCK:  # small: all heads in one group, stacking them costs nothing
        groups = [np.stack(layers).reshape(N * H, cols)]  # (N * H, L_q * L_k)
    else:  # one group per layer, never copied into one array
        groups = [np.ascontiguousarray(y).reshape(H, cols) for y in layers]  # N x (H, ...)
    codes = np.empty((N * H, cols), dtype=np.uint8)
    lo, hi = np.empty(N * H, dtype=np.float32), np.empty(N * H, dtype=np.float32)
    col_step = min(cols, _BLOCK)
    row_step = max(1, _BLOCK // cols)
    scratch = np.empty((min(len(groups[0]), row_step), col_step), dtype=np.float32)
    first = 0  # the group's first head, counted over all layers
    for src in groups:
        rows = len(src)
        g_lo, g_hi = lo[first:first + rows], hi[first:first + rows]  # views, (rows,)
        np.minimum(src.min(axis=1), 0.0, out=g_lo)
        src.max(axis=1, out=g_hi)
        finite = np.isfinite(g_lo) & np.isfinite(g_hi)  # min and max show NaN and inf
        if not finite.all():
            layer = (first + int(np.argmin(finite))) // H
            raise ValueError(f"attentions holds NaN or infinite values (layer {layer})")
        span = np.where(g_hi > g_lo, g_hi - g_lo, 1.0)  # (rows,)
        lo_col = g_lo.reshape(rows, 1)
        factor_col = (levels / span).astype(np.float32).reshape(rows, 1)  # (rows, 1)
        for r in range(0, rows, row_step):
            r_end = min(r + row_step, rows)
            for c in range(0, cols, col_step):
                c_end = min(c + col_step, cols)
                block = scratch[: r_end - r, : c_end - c]
                np.subtract(src[r:r_end, c:c_end], lo_col[r:r_end], out=block)
                np.multiply(block, factor_col[r:r_end], out=block)
                np.rint(block, out=block)  # round half to even
                codes[first + r:first + r_end, c:c_end] = block
        first += rows
    return codes.reshape(N, H, L_q, L_k), lo.reshape(N, H), hi.reshape(N, H)


def encode_weights(x: np.ndarray | Sequence[np.ndarray], *, max_bytes: int = MAX_BYTES,
                   compress: bool = True, binary: bool = False) -> dict[str, object]:
    """Quantise ``(N, H, L_q, L_k)`` weights (one array, or ``N`` arrays ``(H, L_q, L_k)``)
    to 8 bits per value for the HTML viewer.

    Each head is scaled to its own range ``[lo, hi]`` (``lo = min(0, min)``), which is what a
    linear colour map shows anyway: value ``q`` of ``levels`` stands for
    ``lo + q / levels * (hi - lo)``, so the largest error is ``(hi - lo) / (2 * levels)``
    (see :func:`quantize_weights`).
    Large inputs are deflate-compressed (zlib format); real attention is peaked and compresses
    well (512 tokens x 6 layers x 12 heads of all-MiniLM-L6-v2: about 4 MB). If the encoded
    data would still exceed ``max_bytes``, fewer levels (63, then 15) are used.
    ``compress=False`` keeps every size raw with 255 levels (no budget): faster to make, for
    data that crosses a local connection rather than sits in a file (``handformer serve``).
    ``binary=True`` implies ``compress=False`` and gives the bytes themselves instead of
    base64 text, for a transport that carries bytes (``handformer serve``'s binary answer;
    the viewer's ``render()`` takes them as a ``Uint8Array``).

    Returns:
        ``{"encoding": "raw"|"deflate", "levels": int, "data": base64 str,
        "scale": [[lo, hi], ...]}`` with one ``[lo, hi]`` per head, layer-major; with
        ``binary=True`` ``"data"`` is a read-only ``memoryview`` of the ``N * H * L_q * L_k``
        codes in C order.
    """
    compress = compress and not binary
    if isinstance(x, np.ndarray):
        x = np.ascontiguousarray(x, dtype=np.float32)
    q, lo, hi = quantize_weights(x, 255)
    scale = [[round(float(a), 6), round(float(b), 6)]
             for a, b in zip(lo.reshape(-1), hi.reshape(-1), strict=True)]
    for levels in (255, 63, 15):
        if levels != 255:
            q = quantize_weights(x, levels)[0]
        raw = memoryview(q.reshape(-1))  # no extra copy
        if len(raw) <= RAW_LIMIT or not compress:
            encoding, payload = "raw", raw
        else:
            encoding, payload = "deflate", zlib.compress(raw, 4)  # 6 is 3x slower, -10%
        if not compress or 4 * ((len(payload) + 2) // 3) <= max_bytes:  # base64 length
            break
    data = raw.toreadonly() if binary else base64.b64encode(payload).decode("ascii")
    return {"encoding": encoding, "levels": levels, "data": data, "scale": scale}


@dataclass
class LayerSummary:
    """What one layer attends to, in numbers (see :func:`summarize`).

    Attributes:
        layer: layer index.
        top_key: index of the key that receives the most attention (mean over heads, queries).
        top_key_share: that key's share of all attention in the layer (0..1).
        link: ``(head, query, key, weight)`` of the strongest link between two different,
            ordinary (non-special) tokens, or None if there is none.
    """

    layer: int
    top_key: int
    top_key_share: float
    link: tuple[int, int, int, float] | None

    def describe(self, tokens: Sequence[str]) -> str:
        """One line, e.g. ``layer 2: most attention to [SEP] (41%); strongest link it ->
        animal 0.52 (head 7)``."""
        share = f"{self.top_key_share:.0%}" if self.top_key_share >= 0.1 else \
            f"{self.top_key_share:.1%}"
        text = f"layer {self.layer}: most attention to {tokens[self.top_key]} ({share})"
        if self.link is not None:
            head, i, j, w = self.link
            text += f"; strongest link {tokens[i]} -> {tokens[j]} {w:.2f} (head {head})"
        return text


def _is_special(token: str) -> bool:
    return len(token) > 2 and token.startswith(("[", "<")) and token.endswith(("]", ">"))


def summarize(attentions: object, tokens: Sequence[str], *,
              special: Sequence[bool] | None = None, words: Sequence[int] | None = None,
              min_distance: int = 1, include_sink: bool = False) -> list[LayerSummary]:
    """Per layer: the most attended key, and the strongest link between ordinary tokens.

    The first position is an attention sink in most trained models (heads with nothing to do
    park their weight there: GPT-2's and SmolLM2's first word, Gemma's ``<bos>``, BERT's
    ``[CLS]``), so by default it is left out of the links, as a special token is; it still
    counts for "most attention".

    Args:
        attentions: anything :func:`as_attention_array` accepts (self-attention, L_q == L_k).
        tokens: one string per position.
        special: per position, True for special tokens (``[CLS]``, ``[SEP]``, ...) left out of
            the "strongest link"; by default tokens written like ``[XXX]`` or ``<xxx>``.
        words: per position, the index of the word the token belongs to (default: its
            position), so links between pieces of one word can be left out.
        min_distance: a link counts only if its two tokens' word indices differ by at least
            this much (1 = any other word; 2 skips neighbours too).
        include_sink: count links to and from the first position too.

    Returns:
        One :class:`LayerSummary` per layer.

    Raises:
        ValueError: for cross-attention, lengths that do not match, or ``min_distance < 1``.
    """
    x = as_attention_array(attentions)  # (N, H, L, L)
    N, H, L, L_k = x.shape
    if L != L_k:
        raise ValueError(f"summarize needs self-attention (L_q == L_k), got {L} x {L_k}")
    check_tokens(tokens, L)
    if isinstance(min_distance, bool) or not isinstance(min_distance, int) or min_distance < 1:
        raise ValueError(f"min_distance must be an int >= 1, got {min_distance!r}")
    if not isinstance(include_sink, bool):
        raise ValueError(f"include_sink must be True or False, got {include_sink!r}")
    special = [_is_special(t) for t in tokens] if special is None else list(special)
    word = np.arange(L) if words is None else np.asarray(words, dtype=np.int64)
    if len(special) != L or word.shape != (L,):
        raise ValueError(f"special and words must have one entry per token ({L}), got "
                         f"{len(special)} and {word.shape[0] if word.ndim else 0}")
    ordinary = ~np.asarray(special, dtype=bool)  # (L,)
    if not include_sink:
        ordinary[0] = False  # the attention sink
    far = np.abs(word[:, None] - word[None, :]) >= min_distance  # (L, L)
    allowed = far & ordinary[:, None] & ordinary[None, :]  # (L, L)
    out = []
    for n in range(N):
        received = x[n].sum(axis=(0, 1))  # (L,)
        total = float(received.sum())
        top = int(received.argmax())
        share = float(received[top] / total) if total > 0 else 0.0
        links = np.where(allowed, x[n], -1.0)  # (H, L, L)
        h, i, j = np.unravel_index(int(links.argmax()), links.shape)
        link = (int(h), int(i), int(j), float(links[h, i, j])) if links.max() > 0 else None
        out.append(LayerSummary(n, top, share, link))
    return out
