"""A stack of decoder layers with an optional final norm, and its output dataclass.

Shape letters: ``B`` batch, ``H`` heads, ``L`` target length, ``S`` memory length,
``E`` model dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from handformer.decoder_layer import DecoderLayer
from handformer.layers import clones, stack_norm
from handformer.legacy_names import LegacyNames

__all__ = ["Decoder", "DecoderOutput"]


@dataclass
class DecoderOutput:
    """What a decoder stack returns.

    Attributes:
        last_hidden_state: ``(B, L, E)`` output of the last layer (after the final norm).
        self_attentions: one ``(B, H, L, L)`` tensor per layer when ``need_weights=True``.
        cross_attentions: one ``(B, H, L, S)`` tensor per layer when ``need_weights=True``.
    """

    last_hidden_state: Tensor
    self_attentions: tuple[Tensor, ...] | None = None
    cross_attentions: tuple[Tensor, ...] | None = None


class Decoder(LegacyNames, nn.Module):
    """``num_layers`` decoder layers applied in turn (like ``torch.nn.TransformerDecoder``).

    Args:
        layer: a :class:`DecoderLayer` to copy ``num_layers`` times, or a zero-argument
            factory that builds one.
        num_layers: number of layers (>= 1).
        final_norm: ``True`` adds a LayerNorm after the stack, or pass a norm module;
            ``False`` for none. It is ``ln_final``; the layers are ``blocks``.

    Raises:
        ValueError: for ``num_layers < 1``.
        TypeError: if ``layer`` is neither a module nor a factory.
    """

    LEGACY_NAMES = {"layers": "blocks", "norm": "ln_final"}  # handformer.legacy_names

    def __init__(self, layer: DecoderLayer | Callable[[], DecoderLayer], num_layers: int, *,
                 final_norm: bool | nn.Module = False) -> None:
        super().__init__()
        self.blocks = clones(layer, num_layers)
        self.ln_final = stack_norm(self.blocks[0], final_norm)  # hook ln_final.hook_normalized

    def forward(self, x: Tensor, memory: Tensor | None = None, *, mask: Tensor | None = None,
                memory_mask: Tensor | None = None, causal: bool = True,
                need_weights: bool = False) -> DecoderOutput:
        """Run the stack.

        Args:
            x: ``(B, L, E)`` embedded target tokens.
            memory: ``(B, S, E)`` encoder output (None for layers without cross-attention).
            mask: self-attention mask broadcastable to ``(B, H, L, L)`` (bool True = may
                attend, or float bias).
            memory_mask: cross-attention mask broadcastable to ``(B, H, L, S)``; a source
                padding mask is ``(B, 1, 1, S)``.
            causal: causal self-attention (default True).
            need_weights: collect every layer's attention weights.

        Returns:
            :class:`DecoderOutput`.
        """
        self_w, cross_w = [], []
        for layer in self.blocks:
            x, sw, cw = layer.forward_with_weights(x, memory, mask=mask, memory_mask=memory_mask,
                                                   causal=causal, need_weights=need_weights)
            self_w.append(sw)
            cross_w.append(cw)
        if self.ln_final is not None:
            x = self.ln_final(x)
        if not need_weights:
            return DecoderOutput(x)
        return DecoderOutput(x, tuple(self_w),
                             None if cross_w[0] is None else tuple(cross_w))
