"""The encoder-decoder Transformer of "Attention Is All You Need" (as ``torch.nn.Transformer``).

Shape letters: ``B`` batch, ``H`` heads, ``S`` source length, ``L`` target length,
``E`` model dim.

Like ``torch.nn.Transformer`` it takes embedded sequences (no token embedding or output
projection) and has a final LayerNorm after both stacks; unlike it, it is batch-first, masks
follow handformer's convention (True = may attend) and the target side is causal by default.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from handformer.decoder_layer import DecoderLayer
from handformer.layers import EncoderLayer
from handformer.models.decoder import Decoder
from handformer.models.encoder import Encoder
from handformer.norms import LayerNorm

__all__ = ["Transformer", "TransformerOutput"]


@dataclass
class TransformerOutput:
    """What :class:`Transformer` returns.

    Attributes:
        last_hidden_state: ``(B, L, E)`` decoder output.
        memory: ``(B, S, E)`` encoder output.
        encoder_attentions: per encoder layer ``(B, H, S, S)`` (when ``need_weights``).
        decoder_self_attentions: per decoder layer ``(B, H, L, L)``.
        decoder_cross_attentions: per decoder layer ``(B, H, L, S)``.
    """

    last_hidden_state: Tensor
    memory: Tensor
    encoder_attentions: tuple[Tensor, ...] | None = None
    decoder_self_attentions: tuple[Tensor, ...] | None = None
    decoder_cross_attentions: tuple[Tensor, ...] | None = None


class Transformer(nn.Module):
    """Encoder-decoder Transformer.

    Args:
        d_model: model dim ``E``.
        num_heads: attention heads.
        num_encoder_layers: encoder layers.
        num_decoder_layers: decoder layers.
        d_ff: feed-forward hidden dim.
        dropout: dropout everywhere (attention weights, activations, residuals).
        activation: ``"relu"``, ``"gelu"`` or ``"gelu_tanh"``.
        norm_first: pre-LN layers when True.
        layer_norm_eps: LayerNorm epsilon.
        bias: biases in linear layers and LayerNorms.

    Raises:
        ValueError / TypeError: as the layers.
    """

    def __init__(self, d_model: int = 512, num_heads: int = 8, num_encoder_layers: int = 6,
                 num_decoder_layers: int = 6, d_ff: int = 2048, *, dropout: float = 0.1,
                 activation: str = "relu", norm_first: bool = False,
                 layer_norm_eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        options = dict(dropout=dropout, activation=activation, norm_first=norm_first,
                       layer_norm_eps=layer_norm_eps, bias=bias)
        self.d_model = d_model
        self.num_heads = num_heads
        self.encoder = Encoder(EncoderLayer(d_model, num_heads, d_ff, **options),
                               num_encoder_layers,
                               final_norm=LayerNorm(d_model, eps=layer_norm_eps, bias=bias))
        self.decoder = Decoder(DecoderLayer(d_model, num_heads, d_ff, **options),
                               num_decoder_layers,
                               final_norm=LayerNorm(d_model, eps=layer_norm_eps, bias=bias))

    def forward(self, src: Tensor, tgt: Tensor, *, src_mask: Tensor | None = None,
                tgt_mask: Tensor | None = None, memory_mask: Tensor | None = None,
                causal: bool = True, need_weights: bool = False) -> TransformerOutput:
        """Encode ``src`` and decode ``tgt`` against it.

        Args:
            src: ``(B, S, E)`` embedded source.
            tgt: ``(B, L, E)`` embedded target.
            src_mask: encoder self-attention mask, broadcastable to ``(B, H, S, S)``; a source
                padding mask is ``(B, 1, 1, S)`` (use it for ``memory_mask`` too).
            tgt_mask: decoder self-attention mask, broadcastable to ``(B, H, L, L)``.
            memory_mask: cross-attention mask, broadcastable to ``(B, H, L, S)``.
            causal: causal decoder self-attention (default True).
            need_weights: return every layer's attention weights.

        Returns:
            :class:`TransformerOutput`.

        Raises:
            ValueError: for inputs whose batch sizes or feature dims do not match.
        """
        if src.dim() != 3 or tgt.dim() != 3 or src.shape[0] != tgt.shape[0]:
            raise ValueError(f"src (B, S, E) and tgt (B, L, E) must share B, got src "
                             f"{tuple(src.shape)}, tgt {tuple(tgt.shape)}")
        enc = self.encoder(src, src_mask, need_weights=need_weights)
        dec = self.decoder(tgt, enc.last_hidden_state, mask=tgt_mask, memory_mask=memory_mask,
                           causal=causal, need_weights=need_weights)
        return TransformerOutput(dec.last_hidden_state, enc.last_hidden_state, enc.attentions,
                                 dec.self_attentions, dec.cross_attentions)
