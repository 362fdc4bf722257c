"""Model stacks built from handformer layers."""

from handformer.models.causal_lm import CausalLM, CausalLMConfig, CausalLMOutput
from handformer.models.encoder import Encoder, EncoderOutput
from handformer.models.generation import generate

__all__ = ["Encoder", "EncoderOutput", "CausalLM", "CausalLMConfig", "CausalLMOutput",
           "generate"]
