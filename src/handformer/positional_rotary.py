"""Relative position schemes that act inside attention: rotary embeddings (RoPE) and ALiBi.

Shape letters: ``B`` batch, ``H`` heads, ``L`` length (``L_q``/``L_k``), ``D`` head dim.

* **RoPE** (Su et al., "RoFormer", 2021) rotates each pair of query/key features by an angle
  proportional to the token's position, ``theta_i = base^(-2i/D)``; the score
  ``q_m . k_n`` then depends on the positions only through ``m - n``. handformer pairs feature
  ``i`` with feature ``i + D/2`` (the "rotate half" layout used by GPT-NeoX and LLaMA):
  ``x'_i = x_i cos(p theta_i) - x_{i+D/2} sin(p theta_i)``,
  ``x'_{i+D/2} = x_{i+D/2} cos(p theta_i) + x_i sin(p theta_i)``.
* **ALiBi** (Press et al., "Train Short, Test Long", 2022) adds ``-m_h * |p - j|`` to the
  scores of head ``h`` (a float mask in handformer's convention), with head slopes
  ``m_h = 2^(-8 (h+1) / H)`` for ``H`` a power of two (see :func:`alibi_slopes` otherwise).
  With ``causal=True`` only ``j <= p`` remains, which is the paper's ``m_h (j - p)``.

RoPE scaling (longer contexts than a model was trained on) changes the frequencies
``theta_i``, never the rotation:

* ``{"rope_type": "linear", "factor": s}``: every ``theta_i / s`` (position interpolation,
  Chen et al. 2023).
* ``{"rope_type": "llama3", "factor": s, "low_freq_factor": a, "high_freq_factor": b,
  "original_max_position_embeddings": N}`` (Llama 3.1): with the wavelength
  ``lambda_i = 2 pi / theta_i``, high frequencies (``lambda_i < N / b``) are kept, low ones
  (``lambda_i > N / a``) divided by ``s``, and those in between interpolated smoothly:
  ``(1 - t) theta_i / s + t theta_i`` with ``t = (N / lambda_i - a) / (b - a)``.

``freq_dtype`` says in which precision ``theta_i`` is computed: float64 (handformer's own
models) or float32, the arithmetic of Meta's and Hugging Face's code,
``1 / base ** (float32(arange(0, D, 2)) / D)`` then the scaling above in float32, which a
pretrained checkpoint was trained with (the two differ by ~1e-7 relative). The angles
``p * theta_i`` are then always formed in float64.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor, nn

from handformer.checks import check_positive_int

__all__ = ["RotaryEmbedding", "rotate_with_tables", "ALiBi", "alibi_slopes",
           "check_rotary_scaling", "rope_inv_freq", "ROPE_TYPES", "shared_tables"]

ROPE_TYPES = ("linear", "llama3")
_SHARED: ContextVar[dict | None] = ContextVar("handformer_rotary_tables", default=None)


@contextmanager
def shared_tables() -> Iterator[None]:
    """Within the block, a :class:`RotaryEmbedding` called again with the same positions
    tensor reuses its ``cos``/``sin`` table (a model's layers share one per forward pass)
    instead of recomputing it. The tables are dropped when the block ends."""
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)
_ROPE_KEYS = {"linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings")}


def _positive(name: str, value: object) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value <= 0):
        raise ValueError(f"rotary_scaling {name} must be a positive number, got {value!r}")
    return value


def check_rotary_scaling(scaling: object) -> dict | None:
    """Validate a RoPE scaling dict (see the module docstring); returns it (or None).

    Raises:
        ValueError: for a value that is not a dict, an unknown ``rope_type``, a missing or
            unknown key, a non-positive number, or ``high_freq_factor <= low_freq_factor``.
    """
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ValueError(f"rotary_scaling must be a dict with a 'rope_type' or None, got "
                         f"{type(scaling).__name__}")
    kind = scaling.get("rope_type")
    if kind not in ROPE_TYPES:
        raise ValueError(f"rotary_scaling rope_type must be one of {list(ROPE_TYPES)}, got "
                         f"{kind!r}")
    keys = _ROPE_KEYS[kind]
    missing = [k for k in keys if k not in scaling]
    unknown = sorted(set(scaling) - set(keys) - {"rope_type"})
    if missing or unknown:
        raise ValueError(f"rotary_scaling of rope_type {kind!r} takes the keys {list(keys)}; "
                         f"missing {missing}, unknown {unknown}")
    for key in keys:
        _positive(key, scaling[key])
    if kind == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ValueError(f"rotary_scaling high_freq_factor={scaling['high_freq_factor']!r} "
                         f"must exceed low_freq_factor={scaling['low_freq_factor']!r}")
    return scaling


def rope_inv_freq(dim: int, base: float, *, scaling: dict | None = None,
                  dtype: torch.dtype = torch.float64) -> Tensor:
    """The RoPE frequencies ``theta_i`` ``(dim / 2,)`` in ``dtype``, scaled as ``scaling`` says.

    float64 unscaled is ``base ** (-2i / D)`` (handformer's own models, unchanged); otherwise
    the order of operations of Hugging Face's ``modeling_rope_utils``
    (``1 / base ** (arange(0, D, 2) / D)``, then ``/ factor``, or llama3's wavelength bands),
    so that float32 reproduces a pretrained checkpoint's frequencies exactly.
    """
    scaling = check_rotary_scaling(scaling)
    if dtype == torch.float64 and scaling is None:
        return base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype) / dim))
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)

_FLOAT64: dict[str, bool] = {"cpu": True, "cuda": True}  # device type -> holds float64


def has_float64(device: torch.device | str) -> bool:
    """Whether ``device`` holds float64 tensors (CPU and CUDA do, Apple's MPS does not).

    Probed once per device type, with a one-element tensor, for types not known in advance.
    """
    kind = torch.device(device).type
    if kind not in _FLOAT64:
        try:
            torch.zeros(1, dtype=torch.float64, device=device)
            _FLOAT64[kind] = True
        except (TypeError, RuntimeError):  # MPS: "Cannot convert a MPS Tensor to float64"
            _FLOAT64[kind] = False
    return _FLOAT64[kind]


def rotate_with_tables(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """:meth:`RotaryEmbedding.rotate_with` without its checks (for a trusted caller, the
    decoding step): ``x * [cos, cos] + [x2, x1] * [-sin, sin]``, ``x: (..., D)``, in the
    tables' dtype, returned in ``x``'s."""
    xc = x if x.dtype == cos.dtype else x.to(cos.dtype)  # float32 arithmetic for half inputs
    swapped = xc.roll(xc.shape[-1] // 2, dims=-1)  # (..., D): [x2, x1], a copy
    out = (xc * cos).add_(swapped.mul_(sin))  # in place on the two fresh tensors only
    return out if out.dtype == x.dtype else out.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, applied to ``q`` and ``k`` of shape ``(B, H, L, D)``.

    Pass it to ``MultiHeadAttention(..., rotary=RotaryEmbedding(head_dim))``; it has no
    parameters and no table, so any position works (no ``max_len``).

    Args:
        dim: rotated features (the head dim ``D``); must be even.
        base: the frequency base (10000 in the paper).
        scaling: RoPE scaling, ``{"rope_type": "linear" | "llama3", ...}`` (see the module
            docstring); None: none.
        freq_dtype: precision of the frequencies, ``torch.float64`` (the default) or
            ``torch.float32`` (the arithmetic pretrained Llama-family checkpoints use).

    Raises:
        ValueError: for an odd or non-positive ``dim``, ``base <= 1``, an invalid
            ``scaling`` or a ``freq_dtype`` other than float32/float64.
    """

    def __init__(self, dim: int, *, base: float = 10000.0, scaling: dict | None = None,
                 freq_dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        check_positive_int("dim", dim)
        if dim % 2:
            raise ValueError(f"dim must be even for rotary embeddings, got {dim}")
        if isinstance(base, bool) or not isinstance(base, (int, float)) or base <= 1:
            raise ValueError(f"base must be a number > 1, got {base!r}")
        if freq_dtype not in (torch.float32, torch.float64):
            raise ValueError(f"freq_dtype must be torch.float32 or torch.float64, got "
                             f"{freq_dtype!r}")
        self.dim = dim
        self.base = float(base)
        self.scaling = check_rotary_scaling(scaling)
        self.freq_dtype = freq_dtype
        # theta_i held in float64; a plain attribute, not a buffer, so model.to(float16) keeps
        # it (and model.to("mps") does not try to put a float64 tensor where there is none).
        self._inv_freq = rope_inv_freq(dim, self.base, scaling=self.scaling,
                                       dtype=freq_dtype).to(torch.float64)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype, device: torch.device
                ) -> tuple[Tensor, Tensor]:
        """``cos`` and ``sin`` of the angles ``p * theta_i``, each ``(B, 1, L, D/2)``.

        The angles are computed in float64 (``p * theta`` in float32 loses ~1e-4 rad at
        ``p ~ 2000``), then cast to ``dtype`` (float32, or float64 for float64 inputs). On a
        device without float64 (Apple's MPS) they are computed in float64 on the CPU and the
        cast ``cos`` and ``sin`` moved to ``device``: the same values everywhere.
        """
        if positions.dim() == 1:
            positions = positions.unsqueeze(0)  # (1, L)
        where = device if has_float64(device) else torch.device("cpu")
        if self._inv_freq.device != where:
            self._inv_freq = self._inv_freq.to(where)
        angles = positions.to(device=where, dtype=torch.float64)[:, None, :, None] \
            * self._inv_freq  # (B, 1, L, D/2)
        return angles.cos().to(device, dtype), angles.sin().to(device, dtype)

    def tables(self, positions: Tensor, dtype: torch.dtype, device: torch.device
               ) -> tuple[Tensor, Tensor]:
        """The tables :meth:`rotate_with` multiplies by, each ``(B, 1, L, D)``: the cosines
        twice, ``[cos, cos]``, and the sines with the first half negated, ``[-sin, sin]``
        (from :meth:`cos_sin`)."""
        cos, sin = self.cos_sin(positions, dtype, device)  # (B, 1, L, D/2) each
        return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)  # (B, 1, L, D)

    def rotate_with(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotate ``x: (B, H, L, D)`` by the tables of :meth:`tables`, ``(B, 1, L, D)``: one
        table for ``q``, ``k`` and every layer.

        Feature ``i`` of the first half and feature ``i`` of the second, ``(x1, x2)``, turn
        by angle ``p * theta_i`` into ``(x1 cos - x2 sin, x2 cos + x1 sin)``: that is
        ``x * [cos, cos] + [x2, x1] * [-sin, sin]``, the same products and sums (so the same
        bits) as writing the two halves out, in four operations and no concatenation.
        """
        if x.shape[-1] != self.dim:
            raise ValueError(f"x has {x.shape[-1]} features, rotary dim is {self.dim}")
        if cos.shape[-2] != x.shape[-2]:
            raise ValueError(f"positions of length {cos.shape[-2]} do not match the length of "
                             f"x {tuple(x.shape)}")
        if cos.shape[-1] != self.dim:
            raise ValueError(f"rotation tables have {cos.shape[-1]} features, rotary dim is "
                             f"{self.dim} (make them with tables(positions, ...))")
        return rotate_with_tables(x, cos, sin)

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate ``x: (B, H, L, D)`` at ``positions`` ``(B, L)`` or ``(L,)``."""
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        return self.rotate_with(x, *self.tables(positions, compute, x.device))

    def forward(self, q: Tensor, k: Tensor, positions: Tensor | None = None, *,
                offset: int = 0) -> tuple[Tensor, Tensor]:
        """Rotate queries and keys.

        Args:
            q: ``(B, H, L_q, D)``.
            k: ``(B, H, L_k, D)``.
            positions: ``(B, L)`` or ``(L,)`` positions of the tokens (``L_q == L_k``);
                default ``offset + 0 .. L - 1`` (queries aligned to the last keys).
            offset: position of the first key when ``positions`` is None (the cache length).

        Returns:
            ``(q, k)`` rotated, same shapes and dtypes.
        """
        L_q, L_k = q.shape[-2], k.shape[-2]
        if positions is None:  # made where the angles are computed (no copy between devices)
            where = k.device if has_float64(k.device) else torch.device("cpu")
            positions = torch.arange(offset, offset + L_k, device=where)  # (L_k,)
            if L_q != L_k:  # queries aligned to the last keys
                pos_q = torch.arange(offset + L_k - L_q, offset + L_k, device=where)
                return self.rotate(q, pos_q), self.rotate(k, positions)
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        cos, sin = self._table(positions, compute, q.device)  # once for q and k (B, 1, L, D)
        return self.rotate_with(q, cos, sin), self.rotate_with(k, cos, sin)

    def _table(self, positions: Tensor, dtype: torch.dtype, device: torch.device
               ) -> tuple[Tensor, Tensor]:
        """:meth:`tables`, computed once per positions tensor inside a
        :func:`shared_tables` block (a model's forward pass: every layer gets the same
        positions), else every time."""
        if torch.compiler.is_compiling():
            return self.tables(positions, dtype, device)
        shared = _SHARED.get()
        if shared is None:
            return self.tables(positions, dtype, device)
        key = (id(self), id(positions), dtype, device)
        if key not in shared:  # positions kept in the value: its id stays unique meanwhile
            shared[key] = (positions, self.tables(positions, dtype, device))
        return shared[key][1]

    def extra_repr(self) -> str:
        extra = "" if self.scaling is None else f", scaling={self.scaling}"
        extra += ", freq_dtype=torch.float32" if self.freq_dtype == torch.float32 else ""
        return f"dim={self.dim}, base={self.base}{extra}"


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi head slopes ``(H,)`` (float64).

    For ``H`` a power of two: ``2^(-8/H), 2^(-16/H), ..., 2^(-8)``. Otherwise the slopes of
    the nearest lower power of two ``n``, followed by every other slope of ``2n`` (the paper's
    recipe).

    Raises:
        ValueError: for ``num_heads < 1``.
    """
    check_positive_int("num_heads", num_heads)

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    n = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = power_of_two(n)
    if n < num_heads:
        slopes += power_of_two(2 * n)[0::2][: num_heads - n]
    return torch.tensor(slopes, dtype=torch.float64)


class ALiBi(nn.Module):
    """Attention with Linear Biases: a per-head additive bias ``-m_h |p - j|``.

    Args:
        num_heads: number of heads ``H``.

    Raises:
        ValueError: for ``num_heads < 1``.
    """

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        # float64 (H,) on the CPU; a plain attribute, not a buffer, so that module.to("mps")
        # does not try to put a float64 tensor where there is none.
        self.slopes = alibi_slopes(num_heads)
        # An empty buffer that follows module.to(device): the default device of the bias.
        self.register_buffer("_anchor", torch.empty(0), persistent=False)

    def forward(self, L_q: int, L_k: int | None = None, *, dtype: torch.dtype = torch.float32,
                device: torch.device | str | None = None) -> Tensor:
        """The bias ``(H, L_q, L_k)``, to pass as a float ``mask`` (bottom-right aligned).

        Query ``i`` sits at key position ``p = i + L_k - L_q``; entry ``(h, i, j)`` is
        ``-m_h * |p - j|``. Combine with ``causal=True`` for the causal (paper) form.
        Computed in float64 (on the CPU for a device without float64, such as MPS), then
        cast to ``dtype`` on ``device`` (default: the module's device, see ``module.to``).
        """
        L_k = L_q if L_k is None else L_k
        if L_q < 0 or L_k < 0:
            raise ValueError(f"lengths must be >= 0, got L_q={L_q}, L_k={L_k}")
        device = self._anchor.device if device is None else torch.device(device)
        where = device if has_float64(device) else torch.device("cpu")
        p = torch.arange(L_q, device=where).unsqueeze(-1) + (L_k - L_q)  # (L_q, 1)
        j = torch.arange(L_k, device=where)  # (L_k,)
        distance = (p - j).abs().to(torch.float64)  # (L_q, L_k)
        slopes = self.slopes.to(where)[:, None, None]  # (H, 1, 1)
        return (-slopes * distance).to(device, dtype)  # (H, L_q, L_k)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}"
