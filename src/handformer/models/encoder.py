"""A stack of encoder layers with an optional final norm.

Shape letters: ``B`` batch, ``H`` heads, ``L`` length, ``E`` model dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from handformer.layers import EncoderLayer, clones, stack_norm
from handformer.legacy_names import LegacyNames

__all__ = ["Encoder", "EncoderOutput"]


@dataclass
class EncoderOutput:
    """What an encoder stack returns.

    Attributes:
        last_hidden_state: ``(B, L, E)`` output of the last layer (after the final norm).
        attentions: one ``(B, H, L, L)`` tensor per layer when ``need_weights=True``, else None.
    """

    last_hidden_state: Tensor
    attentions: tuple[Tensor, ...] | None = None


class Encoder(LegacyNames, nn.Module):
    """``num_layers`` encoder layers applied in turn.

    Args:
        layer: an :class:`EncoderLayer` to copy ``num_layers`` times (like
            ``torch.nn.TransformerEncoder``), or a zero-argument factory that builds one.
        num_layers: number of layers (>= 1).
        final_norm: ``True`` adds a LayerNorm after the stack (what pre-LN stacks need), or
            pass a norm module; ``False`` for none. It is ``ln_final``; the layers are
            ``blocks``.

    Raises:
        ValueError: for ``num_layers < 1``.
        TypeError: if ``layer`` is neither a module nor a factory.
    """

    LEGACY_NAMES = {"layers": "blocks", "norm": "ln_final"}  # handformer.legacy_names

    def __init__(self, layer: EncoderLayer | Callable[[], EncoderLayer], num_layers: int, *,
                 final_norm: bool | nn.Module = False) -> None:
        super().__init__()
        self.blocks = clones(layer, num_layers)
        self.ln_final = stack_norm(self.blocks[0], final_norm)  # hook ln_final.hook_normalized

    def forward(self, x: Tensor, mask: Tensor | None = None, *, causal: bool = False,
                need_weights: bool = False) -> EncoderOutput:
        """Run the stack.

        Args:
            x: ``(B, L, E)`` embedded inputs.
            mask: bool (True = may attend) or float bias, broadcastable to ``(B, H, L, L)``.
            causal: causal self-attention in every layer.
            need_weights: collect every layer's attention weights.

        Returns:
            :class:`EncoderOutput`.
        """
        attentions = []
        for layer in self.blocks:
            x, weights = layer.forward_with_weights(x, mask, causal=causal,
                                                    need_weights=need_weights)
            attentions.append(weights)
        if self.ln_final is not None:
            x = self.ln_final(x)
        return EncoderOutput(x, tuple(attentions) if need_weights else None)
