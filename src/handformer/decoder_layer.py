"""The decoder layer: causal self-attention, cross-attention to a memory, feed-forward.

Shape letters: ``B`` batch, ``H`` heads, ``L`` target length, ``S`` memory (source) length,
``E`` model dim.

``norm_first=False`` is the original post-LN layer (as ``torch.nn.TransformerDecoderLayer``)::

    x = norm1(x + drop1(self_attn(x)))
    x = norm2(x + drop2(cross_attn(x, memory)))
    x = norm3(x + drop3(ff(x)))

``norm_first=True`` is pre-LN (``x = x + drop1(self_attn(norm1(x)))`` and so on). With
``cross_attention=False`` the middle block is absent: that is the block of a decoder-only
model such as GPT-2 (``CausalLM``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor, nn

from handformer.attention.kinds import AttentionKind
from handformer.hooks import HookPoint
from handformer.layers import Dropout, FeedForward, MultiHeadAttention, attention_dropout
from handformer.norms import LayerNorm

if TYPE_CHECKING:
    from handformer.attention.cache import LayerCache

__all__ = ["DecoderLayer"]


class DecoderLayer(nn.Module):
    """Causal self-attention, optional cross-attention, feed-forward; residuals and LayerNorms.

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

    Hook points, all ``(B, L, E)``: ``hook_resid_pre``, ``hook_attn_out``,
    ``hook_resid_mid``, with cross-attention ``hook_cross_attn_out`` and
    ``hook_resid_mid_cross``, then ``hook_mlp_out`` and ``hook_resid_post`` (as in
    :class:`~handformer.EncoderLayer`).

    Raises:
        ValueError / TypeError: as :class:`MultiHeadAttention` and :class:`FeedForward`.
    """

    def __init__(self, d_model: int, num_heads: int, d_ff: int, *, dropout: float = 0.1,
                 activation: str = "relu", norm_first: bool = False,
                 layer_norm_eps: float = 1e-5, bias: bool = True,
                 attention: AttentionKind | None = None, cross_attention: bool = True,
                 rotary: nn.Module | None = None) -> None:
        super().__init__()
        attn_dropout = attention_dropout(dropout, attention)
        self.d_model = d_model
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, num_heads, dropout=attn_dropout, bias=bias,
                                            attention=attention, rotary=rotary)
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.dropout1 = Dropout(dropout)
        if cross_attention:
            self.cross_attn = MultiHeadAttention(d_model, num_heads, dropout=dropout, bias=bias)
            self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
            self.dropout2 = Dropout(dropout)
        else:
            self.cross_attn = None
        self.ff = FeedForward(d_model, d_ff, activation=activation, dropout=dropout, bias=bias)
        self.norm3 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.dropout3 = Dropout(dropout)
        self.hook_resid_pre, self.hook_resid_mid = HookPoint(), HookPoint()
        self.hook_resid_post = HookPoint()
        self.hook_attn_out, self.hook_mlp_out = HookPoint(), HookPoint()
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
            out, w = self.self_attn(h, mask=mask, causal=causal, need_weights=need_weights,
                                    cache=cache, positions=positions)
            return self.hook_attn_out(self.dropout1(out)), w

        def cross_block(h: Tensor) -> tuple[Tensor, Tensor | None]:
            out, w = self.cross_attn(h, memory, mask=memory_mask, need_weights=need_weights)
            return self.hook_cross_attn_out(self.dropout2(out)), w

        x = self.hook_resid_pre(x)
        if self.norm_first:
            attn, self_weights = self_block(self.norm1(x))
            x = self.hook_resid_mid(x + attn)
            if self.cross_attn is not None:
                attn, cross_weights = cross_block(self.norm2(x))
                x = self.hook_resid_mid_cross(x + attn)
            x = x + self.hook_mlp_out(self.dropout3(self.ff(self.norm3(x))))
        else:
            attn, self_weights = self_block(x)
            x = self.hook_resid_mid(self.norm1(x + attn))
            if self.cross_attn is not None:
                attn, cross_weights = cross_block(x)
                x = self.hook_resid_mid_cross(self.norm2(x + attn))
            x = self.norm3(x + self.hook_mlp_out(self.dropout3(self.ff(x))))
        return self.hook_resid_post(x), self_weights, cross_weights
