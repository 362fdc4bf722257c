"""Model stacks built from handformer layers."""

from handformer.models.encoder import Encoder, EncoderOutput

__all__ = ["Encoder", "EncoderOutput"]
