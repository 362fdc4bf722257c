"""Model stacks built from handformer layers."""

from handformer.models.causal_lm import CausalLM, CausalLMConfig, CausalLMOutput
from handformer.models.decoder import Decoder, DecoderOutput
from handformer.models.encoder import Encoder, EncoderOutput
from handformer.models.generation import generate
from handformer.models.transformer import Transformer, TransformerOutput

__all__ = ["Encoder", "EncoderOutput", "CausalLM", "CausalLMConfig", "CausalLMOutput",
           "generate", "Decoder", "DecoderOutput", "Transformer", "TransformerOutput"]
