"""Transformer building blocks: multi-head attention, feed-forward, encoder layer.

Shape letters: ``B`` batch, ``H`` heads (``H_kv`` key/value heads), ``L`` length
(``L_q``/``L_k``), ``D`` head dim, ``E`` model dim (``d_model = H * D`` unless ``head_dim`` is
given). Modules are batch-first: ``(B, L, E)``.

What differs from the seed's version (sections 3-4): options are keyword-only and validated
when the module is built (``d_model % num_heads``, dropout range, activation name), shapes are
checked with messages that name them, and one module serves any attention kind
(``attention=FullAttention()``, local, strided, linear).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from handformer.attention.functional import repeat_kv
from handformer.attention.kinds import AttentionKind, FullAttention, attend_kind
from handformer.attention.registry import attention_kind
from handformer.checks import check_dropout, check_positive_int, check_scale
from handformer.hooks import HookError, HookPoint
from handformer.legacy_names import LegacyNames
from handformer.norms import LayerNorm, RMSNorm
from handformer.packing import pack_linears
from handformer.weight_views import AttentionViews, GatedMLPViews, MLPViews

if TYPE_CHECKING:
    from handformer.attention.cache import LayerCache

__all__ = ["MultiHeadAttention", "FeedForward", "GatedFeedForward", "EncoderLayer", "Dropout",
           "ACTIVATIONS", "projection_groups"]

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,  # exact erf form (BERT's "gelu")
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's "gelu_new", Gemma's
    "silu": F.silu,  # x * sigmoid(x), Llama's SwiGLU gate
}
# The same functions, overwriting their input (see FeedForward.forward for when).
_IN_PLACE: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": torch.relu_,
    "gelu": torch.ops.aten.gelu_,
    "gelu_tanh": lambda x: torch.ops.aten.gelu_(x, approximate="tanh"),
    "silu": lambda x: F.silu(x, inplace=True),
}


def _may_overwrite(h: Tensor, hook: HookPoint, linear: nn.Linear,
                   activation: Callable[[Tensor], Tensor], name: str) -> bool:
    """Whether nothing else can hold ``h``, the output of ``linear`` seen by ``hook``: no
    autograd, no hook listening on ``hook``, no PyTorch forward hook on ``linear`` (or a global
    one), a stock ``activation`` (not replaced on the module), not compiling. Then the
    activation may overwrite ``h`` instead of allocating a second ``(B, L, d_ff)`` tensor.
    """
    if h.requires_grad or hook.listening() or torch.compiler.is_compiling():
        return False
    if linear._forward_hooks or activation is not ACTIVATIONS.get(name):
        return False
    module = torch.nn.modules.module
    return not getattr(module, "_global_forward_hooks", None)


def check_attention(attention: object) -> AttentionKind:
    """Return ``attention`` as an :class:`AttentionKind`, else raise.

    A name (``"full"``, ``"local"``, ``"strided"``, ``"linear"``) is built by
    :func:`~handformer.attention.attention_kind` with its default options (window 5, stride 3
    and one global token); pass ``attention_kind("local", window_size=7)`` for others.
    """
    if isinstance(attention, str):
        return attention_kind(attention)
    if not isinstance(attention, AttentionKind):
        raise TypeError(
            "attention must be an attention kind such as FullAttention(), LocalAttention(w), "
            "StridedAttention(s) or LinearAttention(), or one of the names 'full', 'local', "
            f"'strided', 'linear', got {type(attention).__name__}"
        )
    return attention


class Dropout(nn.Dropout):
    """``nn.Dropout`` that costs nothing when it is the identity (eval mode, or ``p = 0``).

    The call then returns its input at once instead of going through ``nn.Module.__call__``
    and ``F.dropout`` (a few microseconds each time: a decoding step of a 4-layer model passes
    13 of them). In training with ``p > 0`` it is ``nn.Dropout``.
    """

    def __call__(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        return super().__call__(x)


class MultiHeadAttention(AttentionViews, nn.Module):
    """Multi-head attention: project, split into heads, attend, merge, project.

    Per head, "attend" is the ten lines of
    :func:`~handformer.attention.functional.attention_reference`,
    ``softmax(q kᵀ · scale + mask) v``.

    Args:
        d_model: model dim ``E``; must be divisible by ``num_heads`` unless ``head_dim`` is
            given.
        num_heads: number of query heads ``H``; head dim ``D = E // H`` by default.
        dropout: dropout on the attention weights (training only).
        bias: add biases to the four projections (the default of ``qkv_bias``/``out_bias``).
        kdim: feature dim of ``key`` inputs (default ``d_model``).
        vdim: feature dim of ``value`` inputs (default ``d_model``).
        attention: the attention kind (default :class:`FullAttention`), or its name
            (``"local"``..., see :func:`~handformer.attention.attention_kind`).
        rotary: optional rotary position embedding applied to ``q`` and ``k`` after the
            head split (``handformer.RotaryEmbedding(head_dim)``), called as
            ``rotary(q, k, positions)``.
        num_kv_heads: key/value heads ``H_kv`` (grouped-query attention; 1 is multi-query
            attention); must divide ``num_heads``. None: ``num_heads`` (multi-head).
        head_dim: ``D``, independent of ``d_model`` (Gemma: ``H * D != E``); None:
            ``d_model // num_heads``.
        qkv_bias: biases on the q/k/v projections (None: ``bias``). Qwen2: True.
        out_bias: bias on the output projection (None: ``bias``).
        qk_norm: RMSNorm over each head's ``q`` and ``k`` (``q_norm``, ``k_norm``, weights
            ``(D,)``), before the rotary embedding (Qwen3, Gemma 3).
        qk_norm_eps: their epsilon.
        norm_offset: their weight offset (Gemma: 1.0, see :class:`~handformer.norms.RMSNorm`).
        scale: the softmax scale (None: the kind's default ``1 / sqrt(D)``; Gemma:
            ``query_pre_attn_scalar ** -0.5``).

    Submodules: ``q_proj`` (``E -> H * D``), ``k_proj`` and ``v_proj`` (``-> H_kv * D``),
    ``out_proj`` (``H * D -> E``), ``q_norm``/``k_norm`` (None without ``qk_norm``).

    Grouped-query attention: the keys and values keep their ``H_kv`` heads (and so does a
    decoding cache); query head ``h`` reads key/value head ``h // (H / H_kv)``. Full
    attention hands them to torch's kernel as they are (``enable_gqa``); kinds that need one
    key head per query head, and the explicit path below, get them repeated.

    Hook points (:mod:`handformer.inspect`): ``hook_q`` ``(B, H, L, D)``, ``hook_k``,
    ``hook_v`` ``(B, H_kv, L, D)`` after the projections (before QK-norm; ``hook_rot_q``,
    ``hook_rot_k`` after the rotary embedding, when there is one), ``hook_attn_scores`` and
    ``hook_pattern`` ``(B, H, L_q, L_k)`` (the scores after soft-capping and masking),
    ``hook_z`` ``(B, L_q, H, D)``, the per-head outputs before ``out_proj``, and
    ``hook_result`` ``(B, L_q, H, E)``, each head's output in model space
    (``z_h @ W_O[:, h]``, *without* ``out_proj``'s bias, which belongs to no head: the
    attention output is ``result.sum(heads) + out_proj.bias``); it is computed only while a
    hook listens to it. While a hook listens to the scores or the pattern, the layer
    attends by the explicit path ``normalize(scores) @ v`` (the same numbers up to
    rounding), so that a replaced pattern is the one applied.

    Raises:
        ValueError: for ``num_heads <= 0``, ``d_model % num_heads != 0`` without a
            ``head_dim``, ``num_heads % num_kv_heads != 0``, a bad ``scale``, or dropout
            outside [0, 1).
        TypeError: if ``attention`` is not an attention kind.
    """

    def __init__(self, d_model: int, num_heads: int, *, dropout: float = 0.0, bias: bool = True,
                 kdim: int | None = None, vdim: int | None = None,
                 attention: AttentionKind | str | None = None,
                 rotary: nn.Module | None = None, num_kv_heads: int | None = None,
                 head_dim: int | None = None, qkv_bias: bool | None = None,
                 out_bias: bool | None = None, qk_norm: bool = False,
                 qk_norm_eps: float = 1e-6, norm_offset: float = 0.0,
                 scale: float | None = None) -> None:
        super().__init__()
        check_positive_int("d_model", d_model)
        check_positive_int("num_heads", num_heads)
        if head_dim is None:
            if d_model % num_heads != 0:
                raise ValueError(
                    f"d_model={d_model} is not divisible by num_heads={num_heads}; "
                    f"pick d_model as a multiple of num_heads (or give head_dim)"
                )
            head_dim = d_model // num_heads
        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = check_positive_int("head_dim", head_dim)
        self.num_kv_heads = num_heads if num_kv_heads is None else check_positive_int(
            "num_kv_heads", num_kv_heads)
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} must divide "
                             f"num_heads={num_heads} (each key/value head serves a group of "
                             "query heads)")
        for name, value in (("bias", bias), ("qk_norm", qk_norm), ("qkv_bias", qkv_bias),
                            ("out_bias", out_bias)):
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        qkv_bias = bias if qkv_bias is None else qkv_bias
        out_bias = bias if out_bias is None else out_bias
        self.scale = check_scale(scale)
        self.dropout = check_dropout("dropout", dropout)
        self.kdim = d_model if kdim is None else check_positive_int("kdim", kdim)
        self.vdim = d_model if vdim is None else check_positive_int("vdim", vdim)
        self.attention = check_attention(FullAttention() if attention is None else attention)
        if self.dropout > 0 and not self.attention.supports_dropout:
            raise ValueError(
                f"dropout={dropout}: {type(self.attention).__name__} does not apply dropout to "
                "its weights; use dropout=0.0"
            )
        inner, kv_inner = num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(d_model, inner, bias=qkv_bias)
        self.k_proj = nn.Linear(self.kdim, kv_inner, bias=qkv_bias)
        self.v_proj = nn.Linear(self.vdim, kv_inner, bias=qkv_bias)
        self.out_proj = nn.Linear(inner, d_model, bias=out_bias)
        pack_linears(self.q_proj, self.k_proj, self.v_proj)  # one tensor (self-attention)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=qk_norm_eps, offset=norm_offset)
            self.k_norm = RMSNorm(self.head_dim, eps=qk_norm_eps, offset=norm_offset)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        if rotary is not None:
            self.hook_rot_q, self.hook_rot_k = HookPoint(), HookPoint()
        self.hook_attn_scores, self.hook_pattern = HookPoint(), HookPoint()
        self.hook_z = HookPoint()
        self.hook_result = HookPoint()

    def split_heads(self, x: Tensor, heads: int | None = None) -> Tensor:
        """``(B, L, heads * D)`` -> ``(B, heads, L, D)`` (``heads`` defaults to as many as
        ``x`` holds: ``H``, or this rank's share under tensor parallel)."""
        B, L, _ = x.shape
        heads = -1 if heads is None else heads
        return x.view(B, L, heads, self.head_dim).transpose(1, 2)  # (B, heads, L, D)

    def merge_heads(self, x: Tensor) -> Tensor:
        """``(B, H, L, D)`` -> ``(B, L, H * D)`` (the transpose back the seed warns about)."""
        B, H, L, D = x.shape
        return x.transpose(1, 2).reshape(B, L, H * D)  # (B, L, H * D)

    def forward(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None, *,
                mask: Tensor | None = None, causal: bool = False,
                need_weights: bool = False, cache: LayerCache | None = None,
                positions: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Attend from ``query`` to ``key``/``value`` (self-attention when they are omitted).

        Args:
            query: ``(B, L_q, E)``.
            key: ``(B, L_k, kdim)``; defaults to ``query``.
            value: ``(B, L_k, vdim)``; defaults to ``key``.
            mask: bool (True = may attend) or float bias, broadcastable to
                ``(B, H, L_q, L_k)``; a padding mask is ``(B, 1, 1, L_k)``.
            causal: causal masking, aligned bottom-right.
            need_weights: also return per-head weights ``(B, H, L_q, L_k)``.
            cache: incremental-decoding state of this layer
                (:mod:`handformer.attention.cache`): the new keys/values are added to it and
                the queries attend to everything it holds. ``mask`` is then a key mask for
                the *new* keys only, ``(B, 1, 1, L_q)`` or None.
            positions: ``(B, L_q)`` or ``(L_q,)`` token positions for ``rotary``
                (default ``0 .. L_q - 1``, shifted by the cache length).

        Returns:
            ``(out, weights)``: ``out`` is ``(B, L_q, E)``; ``weights`` or None (with a cache,
            over the keys the cache holds).

        Raises:
            ValueError: for inputs that are not 3-D, wrong feature dims or batch sizes.
        """
        key = query if key is None else key
        value = key if value is None else value
        self._check_inputs(query, key, value)
        # The heads are counted from the projections' outputs: all of them in one process,
        # this rank's under tensor parallel (handformer.distributed), where the hook points
        # gather the full (B, H, ...) tensors for the hooks that listen.
        q = self.hook_q(self.split_heads(self.q_proj(query)))  # (B, H, L_q, D)
        k = self.hook_k(self.split_heads(self.k_proj(key)))  # (B, H_kv, L_k, D)
        v = self.hook_v(self.split_heads(self.v_proj(value)))  # (B, H_kv, L_k, D)
        if self.q_norm is not None:  # QK-norm: each head's vector, before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            offset = cache.seen if cache is not None and positions is None else 0
            q, k = self.rotary(q, k, positions, offset=offset)
            q, k = self.hook_rot_q(q), self.hook_rot_k(k)
        dropout_p = self.dropout if self.training else 0.0
        explicit = self.hook_attn_scores.listening() or self.hook_pattern.listening()
        if cache is not None:
            out, weights = cache.attend(self.attention, q, k, v, causal=causal, mask=mask,
                                        need_weights=need_weights or explicit,
                                        dropout_p=dropout_p, scale=self.scale)
            if explicit:
                weights = self._look_at_cached_pattern(weights, need_weights)
        elif explicit:
            groups = q.shape[1] // k.shape[1]  # query heads per key/value head
            out, weights = self._attend_explicit(q, repeat_kv(k, groups), repeat_kv(v, groups),
                                                 mask, causal, dropout_p)
            weights = weights if need_weights else None
        else:
            out, weights = attend_kind(self.attention, q, k, v, mask, causal=causal,
                                       need_weights=need_weights, dropout_p=dropout_p,
                                       scale=self.scale)
        # Heads back to the feature dim (the transpose the seed warns about forgetting).
        z = self.hook_z(out.transpose(1, 2))  # (B, L_q, H, D)
        if self.hook_result.listening():
            return self._project_per_head(z), weights
        return self.out_proj(z.flatten(2)), weights  # (B, L_q, E)

    def _project_per_head(self, z: Tensor) -> Tensor:
        """``out_proj`` as a sum of per-head terms, through ``hook_result``.

        ``W_O`` ``(E, H * D)`` viewed as ``(E, H, D)``; head ``h`` contributes
        ``z[:, :, h] @ W_O[:, h].T``; the bias is added once, after the sum.
        """
        weight = self.out_proj.weight.view(self.d_model, -1, self.head_dim)  # (E, H, D)
        result = self.hook_result(torch.einsum("blhd,ehd->blhe", z, weight))  # (B, L, H, E)
        out = result.sum(dim=2)  # (B, L_q, E)
        return out if self.out_proj.bias is None else out + self.out_proj.bias

    def _attend_explicit(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                         causal: bool, dropout_p: float) -> tuple[Tensor, Tensor]:
        """``normalize(scores) @ v`` with the scores and the pattern passed through hooks."""
        scores = self.hook_attn_scores(self.attention.scores(
            q, k, causal=causal, mask=mask, scale=self.scale))  # (B, H, L_q, L_k)
        pattern = self.hook_pattern(self.attention.normalize(scores))  # (B, H, L_q, L_k)
        dropped = F.dropout(pattern, p=dropout_p) if dropout_p > 0.0 else pattern
        out = torch.matmul(dropped, v.to(pattern.dtype)).to(v.dtype)  # (B, H, L_q, D)
        return out, pattern.to(q.dtype)

    def _look_at_cached_pattern(self, weights: Tensor, need_weights: bool) -> Tensor | None:
        """With a decoding cache, hooks may read the pattern (over the cached keys) only."""
        if self.hook_attn_scores.listening():
            raise HookError("hook_attn_scores is not available while decoding with a cache; "
                            "run the model without a cache to read or replace the scores")
        seen = self.hook_pattern(weights)
        if seen is not weights:
            raise HookError("hook_pattern may not replace the pattern while decoding with a "
                            "cache; run the model without a cache to patch it")
        return weights if need_weights else None

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        # An int8 projection (handformer.models.quantized) states its activations' dtype:
        # reading its weight would dequantize it.
        dtype = getattr(self.q_proj, "activation_dtype", None) or self.q_proj.weight.dtype
        if query.dtype != dtype and not torch.is_autocast_enabled(query.device.type):
            raise TypeError(
                f"query has dtype {query.dtype} but MultiHeadAttention's weights are {dtype}: "
                f"cast the input (x.to({dtype})) or the module (module.to({query.dtype}), "
                "e.g. .half() for float16)"
            )
        for name, t, dim in (("query", query, self.d_model), ("key", key, self.kdim),
                             ("value", value, self.vdim)):
            if t.dim() != 3 or t.shape[-1] != dim:
                raise ValueError(
                    f"{name} must be (B, L, {dim}) (batch-first), got shape {tuple(t.shape)}"
                )
        if not (query.shape[0] == key.shape[0] == value.shape[0]):
            raise ValueError(
                f"query, key and value must share the batch size B: query "
                f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
            )
        if key.shape[1] != value.shape[1]:
            raise ValueError(
                f"key and value must have the same length L_k: key {tuple(key.shape)}, "
                f"value {tuple(value.shape)}"
            )

    def extra_repr(self) -> str:
        extra = ""
        if self.num_kv_heads != self.num_heads:
            extra += f", num_kv_heads={self.num_kv_heads}"
        if self.head_dim * self.num_heads != self.d_model:
            extra += f", head_dim={self.head_dim}"
        if self.scale is not None:
            extra += f", scale={self.scale}"
        return f"d_model={self.d_model}, num_heads={self.num_heads}{extra}, dropout={self.dropout}"


def _check_ffn(d_model: int, d_ff: int, activation: str) -> tuple[str, Callable[..., Tensor]]:
    """Validate a feed-forward's dims and activation name; return the name and function."""
    check_positive_int("d_model", d_model)
    check_positive_int("d_ff", d_ff)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    return activation, ACTIVATIONS[activation]


class FeedForward(MLPViews, nn.Module):
    """Position-wise feed-forward: ``linear2(dropout(activation(linear1(x))))``.

    Args:
        d_model: model dim ``E``.
        d_ff: hidden dim.
        activation: ``"relu"``, ``"gelu"`` (exact erf) or ``"gelu_tanh"``.
        dropout: dropout after the activation.
        bias: biases on both linear layers.

    Raises:
        ValueError: for non-positive dims, an unknown activation or dropout outside [0, 1).
    """

    def __init__(self, d_model: int, d_ff: int, *, activation: str = "relu",
                 dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        self.activation_name, self.activation = _check_ffn(d_model, d_ff, activation)
        self.linear1 = nn.Linear(d_model, d_ff, bias=bias)
        self.dropout = Dropout(check_dropout("dropout", dropout))
        self.linear2 = nn.Linear(d_ff, d_model, bias=bias)
        self.hook_pre, self.hook_post = HookPoint(), HookPoint()

    def forward(self, x: Tensor) -> Tensor:
        """``(B, L, E)`` -> ``(B, L, E)``; hook points ``hook_pre`` / ``hook_post``
        ``(B, L, d_ff)`` before and after the activation.

        Without autograd (``torch.no_grad``, ``inference_mode``, frozen weights) the
        activation overwrites ``linear1``'s output instead of allocating a second
        ``(B, L, d_ff)`` tensor, unless a hook reads ``hook_pre`` (it may keep that tensor).
        On the CPU each such tensor is fresh memory from the system allocator (tens of MB for
        a batch): one instead of two per layer is what keeps a padded BERT batch at or above
        transformers' speed (benchmarks/bench_embed.py).
        """
        h = self.hook_pre(self.linear1(x))  # (B, L, d_ff)
        if _may_overwrite(h, self.hook_pre, self.linear1, self.activation,
                          self.activation_name):
            h = _IN_PLACE[self.activation_name](h)
        else:
            h = self.activation(h)
        return self.linear2(self.dropout(self.hook_post(h)))


class GatedFeedForward(GatedMLPViews, nn.Module):
    """Gated feed-forward (GLU family): ``down(dropout(act(gate(x)) * up(x)))``.

    SwiGLU (``activation="silu"``: Llama, Mistral, Qwen) and GeGLU (``"gelu_tanh"``: Gemma)
    (Shazeer, "GLU Variants Improve Transformer", 2020): the activation of one projection
    gates another, element by element.

    Args:
        d_model: model dim ``E``.
        d_ff: hidden dim (``intermediate_size``).
        activation: applied to the gate: ``"silu"``, ``"gelu_tanh"``, ``"gelu"`` or
            ``"relu"``.
        bias: biases on the three projections (the families above have none).
        dropout: dropout on the gated hidden vector.

    Submodules: ``gate_proj``, ``up_proj`` (``E -> d_ff``), ``down_proj`` (``d_ff -> E``).

    Hook points, ``(B, L, d_ff)``, named as TransformerLens does: ``hook_pre`` the gate before
    the activation, ``hook_pre_linear`` the ``up`` projection, ``hook_post``
    ``act(gate) * up``.

    Raises:
        ValueError: for non-positive dims, an unknown activation or dropout outside [0, 1).
    """

    def __init__(self, d_model: int, d_ff: int, *, activation: str = "silu", bias: bool = False,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.activation_name, self.activation = _check_ffn(d_model, d_ff, activation)
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)
        pack_linears(self.gate_proj, self.up_proj)  # [W_gate; W_up] in one tensor
        self.dropout = Dropout(check_dropout("dropout", dropout))
        self.hook_pre, self.hook_pre_linear = HookPoint(), HookPoint()
        self.hook_post = HookPoint()

    def forward(self, x: Tensor) -> Tensor:
        """``(B, L, E)`` -> ``(B, L, E)``."""
        gate = self.hook_pre(self.gate_proj(x))  # (B, L, d_ff)
        up = self.hook_pre_linear(self.up_proj(x))  # (B, L, d_ff)
        if _may_overwrite(gate, self.hook_pre, self.gate_proj, self.activation,
                          self.activation_name):  # as FeedForward: no second, third tensor
            h = _IN_PLACE[self.activation_name](gate).mul_(up)
        else:
            h = self.activation(gate) * up
        return self.down_proj(self.dropout(self.hook_post(h)))


def projection_groups(model: nn.Module) -> list[tuple[nn.Linear, ...]]:
    """The projections of ``model`` that read one input, which the constructors store back to
    back (:mod:`handformer.packing`): ``(q_proj, k_proj, v_proj)`` of every
    :class:`MultiHeadAttention` and ``(gate_proj, up_proj)`` of every
    :class:`GatedFeedForward`. A loader that installs a checkpoint's tensors lays them out so.
    """
    groups: list[tuple[nn.Linear, ...]] = []
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            groups.append((module.q_proj, module.k_proj, module.v_proj))
        elif isinstance(module, GatedFeedForward):
            groups.append((module.gate_proj, module.up_proj))
    return groups


class EncoderLayer(LegacyNames, nn.Module):
    """Self-attention + feed-forward, each with a residual connection and LayerNorm.

    ``norm_first=False`` is the original post-LN layer (the seed's):
    ``x = ln1(x + drop(attn(x))); x = ln2(x + drop(mlp(x)))``. ``norm_first=True`` is
    pre-LN: ``x = x + drop(attn(ln1(x))); x = x + drop(mlp(ln2(x)))``, which trains more
    stably in deep stacks (and then needs a final norm after the stack).

    One name per part (module path = hook name, as :class:`~handformer.DecoderLayer`'s table;
    the Hugging Face BERT key of ``blocks.{i}.`` is ``encoder.layer.{i}.`` + the last column):

    ========  ===================================================  ==============================
    module    hooks (``blocks.{i}.`` + ...)                        Hugging Face BERT key
    ========  ===================================================  ==============================
    ``attn``  ``attn.hook_q`` ... ``attn.hook_result``             ``attention.self.query`` ...
    ``ln1``   ``ln1.hook_scale``, ``ln1.hook_normalized``          ``attention.output.LayerNorm``
    ``mlp``   ``mlp.hook_pre``, ``mlp.hook_post``                  ``intermediate.dense``,
                                                                   ``output.dense``
    ``ln2``   ``ln2.hook_scale``, ``ln2.hook_normalized``          ``output.LayerNorm``
    ========  ===================================================  ==============================

    Args:
        d_model: model dim ``E``.
        num_heads: attention heads.
        d_ff: feed-forward hidden dim.
        dropout: dropout on attention weights, after the activation and on both residuals.
        activation: feed-forward activation (``"relu"``, ``"gelu"``, ``"gelu_tanh"``).
        norm_first: pre-LN when True, post-LN when False.
        layer_norm_eps: LayerNorm epsilon.
        bias: biases in the linear layers and LayerNorms.
        attention: the attention kind (default full), or its name.

    Hook points: ``hook_resid_pre`` (the layer's input), ``hook_attn_out`` (the attention
    sublayer's output, as added to the residual), ``hook_resid_mid`` (the residual after
    it: after ``ln1`` when post-LN), ``hook_mlp_in`` (the MLP branch's input; a replacement
    changes that branch only), ``hook_mlp_out`` and ``hook_resid_post`` (the layer's output),
    all ``(B, L, E)``.

    Raises:
        ValueError / TypeError: as :class:`MultiHeadAttention` and :class:`FeedForward`.
    """

    LEGACY_NAMES = {"self_attn": "attn", "ff": "mlp", "norm1": "ln1", "norm2": "ln2"}

    def __init__(self, d_model: int, num_heads: int, d_ff: int, *, dropout: float = 0.1,
                 activation: str = "relu", norm_first: bool = False,
                 layer_norm_eps: float = 1e-5, bias: bool = True,
                 attention: AttentionKind | str | None = None) -> None:
        super().__init__()
        attn_dropout = attention_dropout(dropout, attention)
        self.d_model = d_model
        self.norm_first = norm_first
        self.attn = MultiHeadAttention(d_model, num_heads, dropout=attn_dropout, bias=bias,
                                       attention=attention)
        self.mlp = FeedForward(d_model, d_ff, activation=activation, dropout=dropout, bias=bias)
        self.ln1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.ln2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.hook_resid_pre, self.hook_resid_mid = HookPoint(), HookPoint()
        self.hook_resid_post = HookPoint()
        self.hook_attn_out, self.hook_mlp_out = HookPoint(), HookPoint()
        self.hook_mlp_in = HookPoint()

    def forward(self, x: Tensor, mask: Tensor | None = None, *, causal: bool = False) -> Tensor:
        """``(B, L, E)`` -> ``(B, L, E)``. ``mask`` broadcasts to ``(B, H, L, L)``."""
        return self.forward_with_weights(x, mask, causal=causal, need_weights=False)[0]

    def forward_with_weights(self, x: Tensor, mask: Tensor | None = None, *,
                             causal: bool = False, need_weights: bool = True
                             ) -> tuple[Tensor, Tensor | None]:
        """Like :meth:`forward`, also returning the per-head weights ``(B, H, L, L)``."""
        x = self.hook_resid_pre(x)
        if self.norm_first:
            attn, weights = self.attn(self.ln1(x), mask=mask, causal=causal,
                                      need_weights=need_weights)
            x = self.hook_resid_mid(x + self.hook_attn_out(self.dropout1(attn)))
            h = self.ln2(self.hook_mlp_in(x))
            x = x + self.hook_mlp_out(self.dropout2(self.mlp(h)))
        else:
            attn, weights = self.attn(x, mask=mask, causal=causal, need_weights=need_weights)
            x = self.hook_resid_mid(self.ln1(x + self.hook_attn_out(self.dropout1(attn))))
            x = self.ln2(x + self.hook_mlp_out(self.dropout2(self.mlp(self.hook_mlp_in(x)))))
        return self.hook_resid_post(x), weights


def stack_norm(first: nn.Module, final_norm: bool | nn.Module) -> nn.Module | None:
    """The norm after a stack: a LayerNorm like ``first.ln1`` (True), a module, or None."""
    if final_norm is True:
        return LayerNorm(first.d_model, eps=first.ln1.eps)
    if isinstance(final_norm, nn.Module):
        return final_norm
    return None


def attention_dropout(dropout: float, attention: AttentionKind | None) -> float:
    """Dropout on the attention weights: ``dropout``, or 0 for kinds that apply none.

    Kinds without weight dropout (local, strided, linear) keep the residual dropouts.
    """
    check_dropout("dropout", dropout)
    if attention is not None and not check_attention(attention).supports_dropout:
        return 0.0
    return dropout


def clones(layer: nn.Module | Callable[[], nn.Module], n: int) -> nn.ModuleList:
    """``n`` independent layers: deep copies of a module, or ``n`` calls of a factory."""
    check_positive_int("num_layers", n)
    if isinstance(layer, nn.Module):
        return nn.ModuleList(copy.deepcopy(layer) for _ in range(n))
    if callable(layer):
        return nn.ModuleList(layer() for _ in range(n))
    raise TypeError(f"layer must be a module or a factory, got {type(layer).__name__}")
