"""The configuration of a :class:`~handformer.models.causal_lm.CausalLM`: a small dataclass,
validated on creation and saved as ``config.json`` beside the weights."""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields

from handformer.attention.kinds import AttentionKind, FullAttention
from handformer.checks import check_dropout, check_positive_int, check_window_size
from handformer.layers import ACTIVATIONS

__all__ = ["CausalLMConfig", "POSITIONALS", "ATTENTIONS"]

POSITIONALS = ("learned", "sinusoidal", "rotary")
ATTENTIONS = ("full", "local", "strided", "linear")


@dataclass
class CausalLMConfig:
    """Hyper-parameters of a decoder-only language model.

    Attributes:
        vocab_size: number of token ids.
        max_len: context length (longest sequence, prompt plus generated tokens).
        d_model: model dim ``E``.
        num_heads: attention heads (must divide ``d_model``).
        num_layers: decoder layers.
        d_ff: feed-forward hidden dim.
        dropout: dropout on embeddings, attention weights, activations and residuals.
        activation: ``"relu"``, ``"gelu"`` or ``"gelu_tanh"`` (GPT-2's ``gelu_new``).
        positional: ``"learned"`` (GPT-2), ``"sinusoidal"`` or ``"rotary"`` (RoPE in every
            layer's self-attention; needs an even head dim).
        attention: ``"full"``, ``"local"`` (needs ``window_size``), ``"strided"`` (needs
            ``stride``) or ``"linear"``.
        window_size: local attention window, odd (only with ``attention="local"``).
        stride: strided attention stride (only with ``attention="strided"``).
        tie_weights: the LM head shares the token-embedding matrix.
        norm_first: pre-LN layers plus a final LayerNorm (GPT-2) when True; post-LN when
            False.
        layer_norm_eps: LayerNorm epsilon.
        bias: biases in linear layers and LayerNorms.
        rotary_base: RoPE frequency base (only with ``positional="rotary"``).

    Raises:
        ValueError: on creation, for any invalid value (the message names the field).
    """

    vocab_size: int
    max_len: int
    d_model: int
    num_heads: int
    num_layers: int
    d_ff: int
    dropout: float = 0.0
    activation: str = "gelu"
    positional: str = "learned"
    attention: str = "full"
    window_size: int | None = None
    stride: int | None = None
    tie_weights: bool = True
    norm_first: bool = True
    layer_norm_eps: float = 1e-5
    bias: bool = True
    rotary_base: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_len", "d_model", "num_heads", "num_layers", "d_ff"):
            check_positive_int(name, getattr(self, name))
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by "
                             f"num_heads={self.num_heads}")
        check_dropout("dropout", self.dropout)
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, "
                             f"got {self.activation!r}")
        if self.positional not in POSITIONALS:
            raise ValueError(f"positional must be one of {list(POSITIONALS)}, "
                             f"got {self.positional!r}")
        if self.positional == "rotary" and (self.d_model // self.num_heads) % 2:
            raise ValueError(f"positional='rotary' needs an even head dim, got d_model="
                             f"{self.d_model} / num_heads={self.num_heads} = "
                             f"{self.d_model // self.num_heads}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {list(ATTENTIONS)}, "
                             f"got {self.attention!r}")
        for name, kind in (("window_size", "local"), ("stride", "strided")):
            value = getattr(self, name)
            if self.attention == kind == "local":
                check_window_size(value)  # odd: an even window would act as the next odd one
            elif self.attention == kind:
                check_positive_int(name, value)
            elif value is not None:
                raise ValueError(f"{name}={value!r} is only used with attention={kind!r}, "
                                 f"not attention={self.attention!r}; leave it None")
        for name in ("tie_weights", "norm_first", "bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("layer_norm_eps", "rotary_base"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.rotary_base <= 1:
            raise ValueError(f"rotary_base must be > 1, got {self.rotary_base!r}")

    @property
    def head_dim(self) -> int:
        """``d_model // num_heads``."""
        return self.d_model // self.num_heads

    def to_dict(self) -> dict:
        """The fields as a JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CausalLMConfig:
        """Build a config from :meth:`to_dict`'s output.

        Raises:
            ValueError: for unknown or missing fields, and any invalid value.
        """
        if not isinstance(data, dict):
            raise ValueError(f"a CausalLMConfig is read from a dict, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown CausalLMConfig fields {unknown}; known: {sorted(known)}")
        required = {f.name for f in fields(cls) if f.default is MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise ValueError(f"CausalLMConfig is missing required fields {missing}")
        return cls(**data)

    def make_attention(self) -> AttentionKind:
        """A fresh instance of the configured attention kind."""
        if self.attention == "full":
            return FullAttention()
        if self.attention == "local":
            from handformer.attention.local import LocalAttention

            return LocalAttention(self.window_size)
        if self.attention == "strided":
            from handformer.attention.sparse import StridedAttention

            return StridedAttention(self.stride)
        from handformer.attention.linear import LinearAttention

        return LinearAttention()
