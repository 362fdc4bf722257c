"""The decoder layer: causal self-attention, cross-attention to a memory, feed-forward.

Shape letters: ``B`` batch, ``H`` heads, ``L`` target length, ``S`` memory (source) length,
``E`` model dim.

``norm_first=False`` is the original post-LN layer (as ``torch.nn.TransformerDecoderLayer``)::

    x = ln1(x + drop1(attn(x)))
    x = ln_cross(x + drop2(cross_attn(x, memory)))
    x = ln2(x + drop3(mlp(x)))

``norm_first=True`` is pre-LN (``x = x + drop1(attn(ln1(x)))`` and so on). With
``cross_attention=False`` the middle block is absent: that is the block of a decoder-only
model such as GPT-2 (``CausalLM``).

The Llama family is the same block with other parts (keyword options, all off by default):
RMSNorm instead of LayerNorm (``norm="rms"``, Gemma's ``1 + w`` with ``norm_offset=1.0``),
a gated MLP (``mlp="gated"``), grouped-query attention (``num_kv_heads``, ``head_dim``),
per-projection biases, QK-norm, an attention scale, and Gemma's sandwich norms
(``sandwich_norm=True``): a norm on each sublayer's output before the residual sum::

    x = x + ln1_post(attn(ln1(x)))
    x = x + ln2_post(mlp(ln2(x)))

One name per part: a submodule's path is its hook name (``blocks.3.attn.hook_pattern`` is
``model.blocks[3].attn.hook_pattern``), as in TransformerLens. The names before that
(``self_attn``, ``ff``, ``norm1``...) still load and read, with a warning
(:mod:`handformer.legacy_names`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor, nn

from handformer.attention.kinds import AttentionKind
from handformer.hooks import HookPoint
from handformer.layers import (
    Dropout,
    FeedForward,
    GatedFeedForward,
    MultiHeadAttention,
    attention_dropout,
)
from handformer.legacy_names import LegacyNames
from handformer.norms import make_norm

if TYPE_CHECKING:
    from handformer.attention.cache import LayerCache

__all__ = ["DecoderLayer"]


class DecoderLayer(LegacyNames, nn.Module):
    """Causal self-attention, optional cross-attention, feed-forward; residuals and norms.

    The block of a decoder-only model (``norm_first=True``, as GPT-2, Llama and Gemma), one
    residual stream ``x`` of shape ``(B, L, E)`` with two branches added to it; ``[...]`` only
    with ``sandwich_norm=True`` (Gemma)::

        x ---------------------------.     hook_resid_pre
        |                            |
        |                           ln1    ln1.hook_scale, ln1.hook_normalized
        |                            |
        |                   attn (causal)  attn.hook_q ... attn.hook_pattern, attn.hook_z
        |                            |
        |                       [ln1_post]
        |                            |
        + <----- dropout1 -----------'     hook_attn_out joins here
        |                                  hook_resid_mid
        +----------------------------.     hook_mlp_in
        |                            |
        |                           ln2    ln2.hook_normalized: what the MLP reads
        |                            |
        |                           mlp    mlp.hook_pre, mlp.hook_post
        |                            |
        |                       [ln2_post]
        |                            |
        + <----- dropout3 -----------'     hook_mlp_out joins here
        |                                  hook_resid_post
        v

    With ``cross_attention=True`` a third branch, ``ln_cross -> cross_attn(memory)``, joins
    between the two (``hook_resid_mid_cross``). Post-LN (``norm_first=False``) puts each norm
    after its sum instead: ``x = ln1(x + dropout1(attn(x)))`` (the module docstring).

    One name per part: the module path is the hook name, and the Hugging Face key of each
    part (Llama / Qwen / Mistral, Gemma where it differs, GPT-2; ``model.layers.{i}.`` and
    ``transformer.h.{i}.`` left out) reads off the same row:

    =================  ===========================================  ==============================
    module             hooks (``blocks.{i}.`` + ...)                Hugging Face key
    =================  ===========================================  ==============================
    ``ln1``            ``ln1.hook_scale``, ``ln1.hook_normalized``  ``input_layernorm``; ``ln_1``
    ``attn``           ``attn.hook_q`` ... ``attn.hook_result``     ``self_attn.{q,k,v,o}_proj``;
                                                                    ``attn.c_attn``, ``c_proj``
    ``attn.q_norm``    ``attn.q_norm.hook_normalized``              ``self_attn.q_norm`` (Qwen3,
                                                                    Gemma 3)
    ``ln1_post``       ``ln1_post.hook_normalized``                 Gemma's
                                                                    ``post_attention_layernorm``
    (residual)         ``hook_resid_pre``, ``hook_attn_out``,       --
                       ``hook_resid_mid``, ``hook_mlp_in``
    ``ln_cross``       ``ln_cross.hook_normalized``                 (encoder-decoder only)
    ``cross_attn``     ``cross_attn.hook_pattern`` ...              (encoder-decoder only)
    ``ln2``            ``ln2.hook_scale``, ``ln2.hook_normalized``  ``post_attention_layernorm``
                                                                    (Gemma: ``pre_feedforward_
                                                                    layernorm``); ``ln_2``
    ``mlp``            ``mlp.hook_pre``, ``mlp.hook_pre_linear``,   ``mlp.{gate,up,down}_proj``;
                       ``mlp.hook_post``                            ``mlp.c_fc``, ``mlp.c_proj``
    ``ln2_post``       ``ln2_post.hook_normalized``                 Gemma's ``post_feedforward_
                                                                    layernorm``
    (residual)         ``hook_mlp_out``, ``hook_resid_post``        --
    =================  ===========================================  ==============================

    The stack's final norm is ``ln_final`` (``ln_final.hook_normalized``; Hugging Face
    ``model.norm``, GPT-2 ``transformer.ln_f``).

    Args:
        d_model: model dim ``E``.
        num_heads: attention heads.
        d_ff: feed-forward hidden dim.
        dropout: dropout on attention weights, after the activation and on the residuals.
        activation: ``"relu"``, ``"gelu"`` or ``"gelu_tanh"``.
        norm_first: pre-LN when True, post-LN when False.
        layer_norm_eps: LayerNorm epsilon.
        bias: biases in the linear layers and LayerNorms.
        attention: the self-attention kind (default full); cross-attention is always full.
        cross_attention: include the cross-attention block (False for decoder-only models).
        rotary: optional :class:`handformer.RotaryEmbedding` for the self-attention.
        norm: ``"layer"`` (LayerNorm) or ``"rms"`` (RMSNorm) for every norm of the layer.
        norm_offset: RMSNorm's weight offset (Gemma: 1.0), QK-norms included.
        mlp: ``"plain"`` (:class:`FeedForward`) or ``"gated"`` (:class:`GatedFeedForward`).
        mlp_bias: biases of the MLP (None: ``bias``).
        sandwich_norm: norms ``ln1_post`` and ``ln2_post`` on the sublayer outputs (pre-norm
            layers only).
        num_kv_heads, head_dim, qkv_bias, out_bias, qk_norm: the self-attention's options
            (see :class:`MultiHeadAttention`; the QK-norms use ``layer_norm_eps``).
        attn_scale: the self-attention's softmax scale (None: ``1 / sqrt(head_dim)``).

    Submodules: ``attn``, ``ln1`` (before attention), ``cross_attn`` and ``ln_cross`` (with
    cross-attention), ``mlp``, ``ln2`` (before the MLP), ``ln1_post`` and ``ln2_post``
    (sandwich norms only; else None).

    Hook points, all ``(B, L, E)``: ``hook_resid_pre``, ``hook_attn_out`` (as added to the
    residual: after ``ln1_post``), ``hook_resid_mid``, with cross-attention
    ``hook_cross_attn_out`` and ``hook_resid_mid_cross``, then ``hook_mlp_in`` (the MLP
    branch's input, before ``ln2`` when pre-LN: a replacement changes the MLP branch only,
    not the residual it is added to, as TransformerLens' ``use_hook_mlp_in``),
    ``hook_mlp_out`` and ``hook_resid_post`` (as in :class:`~handformer.EncoderLayer`).

    Raises:
        ValueError / TypeError: as :class:`MultiHeadAttention` and :class:`FeedForward`; for
            an unknown ``norm`` or ``mlp``, or ``sandwich_norm`` without ``norm_first``.
    """

    LEGACY_NAMES = {"self_attn": "attn", "ff": "mlp", "norm1": "ln1", "norm2": "ln_cross",
                    "norm3": "ln2", "post_attn_norm": "ln1_post", "post_mlp_norm": "ln2_post"}

    def __init__(self, d_model: int, num_heads: int, d_ff: int, *, dropout: float = 0.1,
                 activation: str = "relu", norm_first: bool = False,
                 layer_norm_eps: float = 1e-5, bias: bool = True,
                 attention: AttentionKind | None = None, cross_attention: bool = True,
                 rotary: nn.Module | None = None, norm: str = "layer",
                 norm_offset: float = 0.0, mlp: str = "plain", mlp_bias: bool | None = None,
                 sandwich_norm: bool = False, num_kv_heads: int | None = None,
                 head_dim: int | None = None, qkv_bias: bool | None = None,
                 out_bias: bool | None = None, qk_norm: bool = False,
                 attn_scale: float | None = None) -> None:
        super().__init__()
        attn_dropout = attention_dropout(dropout, attention)
        if mlp not in ("plain", "gated"):
            raise ValueError(f"mlp must be one of ['plain', 'gated'], got {mlp!r}")
        if not isinstance(sandwich_norm, bool):
            raise ValueError(f"sandwich_norm must be True or False, got {sandwich_norm!r}")
        if sandwich_norm and not norm_first:
            raise ValueError("sandwich_norm=True needs norm_first=True (pre-norm layers with a "
                             "norm on each sublayer's output too)")
        self.d_model = d_model
        self.norm_first = norm_first

        def new_norm() -> nn.Module:
            return make_norm(norm, d_model, eps=layer_norm_eps, offset=norm_offset, bias=bias)

        self.attn = MultiHeadAttention(
            d_model, num_heads, dropout=attn_dropout, bias=bias, attention=attention,
            rotary=rotary, num_kv_heads=num_kv_heads, head_dim=head_dim, qkv_bias=qkv_bias,
            out_bias=out_bias, qk_norm=qk_norm, qk_norm_eps=layer_norm_eps,
            norm_offset=norm_offset, scale=attn_scale)
        self.ln1 = new_norm()
        self.dropout1 = Dropout(dropout)
        if cross_attention:
            self.cross_attn = MultiHeadAttention(d_model, num_heads, dropout=dropout, bias=bias)
            self.ln_cross = new_norm()
            self.dropout2 = Dropout(dropout)
        else:
            self.cross_attn = None
        mlp_bias = bias if mlp_bias is None else mlp_bias
        if mlp == "gated":
            self.mlp = GatedFeedForward(d_model, d_ff, activation=activation, dropout=dropout,
                                        bias=mlp_bias)
        else:
            self.mlp = FeedForward(d_model, d_ff, activation=activation, dropout=dropout,
                                   bias=mlp_bias)
        self.ln2 = new_norm()
        self.dropout3 = Dropout(dropout)
        self.ln1_post = new_norm() if sandwich_norm else None
        self.ln2_post = new_norm() if sandwich_norm else None
        self.hook_resid_pre, self.hook_resid_mid = HookPoint(), HookPoint()
        self.hook_resid_post = HookPoint()
        self.hook_attn_out, self.hook_mlp_out = HookPoint(), HookPoint()
        self.hook_mlp_in = HookPoint()
        if cross_attention:
            self.hook_cross_attn_out, self.hook_resid_mid_cross = HookPoint(), HookPoint()

    def forward(self, x: Tensor, memory: Tensor | None = None, *, mask: Tensor | None = None,
                memory_mask: Tensor | None = None, causal: bool = True) -> Tensor:
        """``(B, L, E)`` -> ``(B, L, E)``; see :meth:`forward_with_weights`."""
        return self.forward_with_weights(x, memory, mask=mask, memory_mask=memory_mask,
                                         causal=causal, need_weights=False)[0]

    def forward_with_weights(
        self, x: Tensor, memory: Tensor | None = None, *, mask: Tensor | None = None,
        memory_mask: Tensor | None = None, causal: bool = True, need_weights: bool = True,
        cache: LayerCache | None = None, positions: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Run the layer, also returning the self- and cross-attention weights.

        Args:
            x: ``(B, L, E)`` target-side inputs.
            memory: ``(B, S, E)`` encoder output; required iff the layer has cross-attention.
            mask: self-attention mask, bool (True = may attend) or float bias, broadcastable to
                ``(B, H, L, L)``; with a cache, a bool key mask of the new tokens
                ``(B, 1, 1, L)``.
            memory_mask: cross-attention mask broadcastable to ``(B, H, L, S)``.
            causal: causal self-attention (the default; a decoder predicts the next token).
            need_weights: return the weights (else None in their place).
            cache: this layer's decoding cache (self-attention only).
            positions: ``(B, L)`` token positions for rotary embeddings.

        Returns:
            ``(x, self_weights, cross_weights)``: ``(B, L, E)``, ``(B, H, L, L_k)``,
            ``(B, H, L, S)`` (None when not asked for or without cross-attention).

        Raises:
            ValueError: if ``memory`` is missing for a layer with cross-attention, or given to
                one without.
        """
        if self.cross_attn is not None and memory is None:
            raise ValueError("this DecoderLayer has cross-attention: pass memory (B, S, E)")
        if self.cross_attn is None and memory is not None:
            raise ValueError("this DecoderLayer has no cross-attention (cross_attention=False) "
                             "but memory was given")
        cross_weights = None

        def self_block(h: Tensor) -> tuple[Tensor, Tensor | None]:
            out, w = self.attn(h, mask=mask, causal=causal, need_weights=need_weights,
                                    cache=cache, positions=positions)
            if self.ln1_post is not None:
                out = self.ln1_post(out)
            return self.hook_attn_out(self.dropout1(out)), w

        def mlp_block(h: Tensor) -> Tensor:
            out = self.mlp(h)
            if self.ln2_post is not None:
                out = self.ln2_post(out)
            return self.hook_mlp_out(self.dropout3(out))

        def cross_block(h: Tensor) -> tuple[Tensor, Tensor | None]:
            out, w = self.cross_attn(h, memory, mask=memory_mask, need_weights=need_weights)
            return self.hook_cross_attn_out(self.dropout2(out)), w

        x = self.hook_resid_pre(x)
        if self.norm_first:
            attn, self_weights = self_block(self.ln1(x))
            x = self.hook_resid_mid(x + attn)
            if self.cross_attn is not None:
                attn, cross_weights = cross_block(self.ln_cross(x))
                x = self.hook_resid_mid_cross(x + attn)
            x = x + mlp_block(self.ln2(self.hook_mlp_in(x)))
        else:
            attn, self_weights = self_block(x)
            x = self.hook_resid_mid(self.ln1(x + attn))
            if self.cross_attn is not None:
                attn, cross_weights = cross_block(x)
                x = self.hook_resid_mid_cross(self.ln_cross(x + attn))
            x = self.ln2(x + mlp_block(self.hook_mlp_in(x)))
        return self.hook_resid_post(x), self_weights, cross_weights
