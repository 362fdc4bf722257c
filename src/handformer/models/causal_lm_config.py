"""The configuration of a :class:`~handformer.models.causal_lm.CausalLM`: a small dataclass,
validated on creation and saved as ``config.json`` beside the weights.

One decoder covers GPT-2 and the Llama family: every difference is a field, off by default
(the defaults are GPT-2's architecture), never switched on by a model's name.

=====================  =====================================================================
feature                fields
=====================  =====================================================================
RMSNorm, Gemma's 1+w   ``norm="rms"``, ``norm_offset=1.0``, ``layer_norm_eps``
gated MLP (SwiGLU...)  ``mlp="gated"``, ``activation="silu"`` / ``"gelu_tanh"``
grouped-query attn     ``num_kv_heads``, ``head_dim``
biases                 ``bias`` (default of) ``qkv_bias``, ``out_bias``, ``mlp_bias``
QK-norm                ``qk_norm``
sandwich norms         ``sandwich_norm``
scales and caps        ``embed_scale``, ``attn_scale``, ``attn_softcap``, ``final_softcap``
sliding windows        ``layer_types`` (``"full"`` / ``"local"`` per layer), ``window_size``
RoPE                   ``rotary_base``, ``rotary_local_base``, ``rotary_scaling``,
                       ``rotary_freq_dtype``
=====================  =====================================================================
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, fields

from handformer.attention.kinds import AttentionKind, FullAttention
from handformer.checks import check_dropout, check_positive_int, check_window_size
from handformer.layers import ACTIVATIONS
from handformer.norms import NORMS
from handformer.positional_rotary import check_rotary_scaling

__all__ = ["CausalLMConfig", "POSITIONALS", "ATTENTIONS", "LAYER_TYPES", "MLPS"]

POSITIONALS = ("learned", "sinusoidal", "rotary")
ATTENTIONS = ("full", "local", "strided", "linear")
LAYER_TYPES = ("full", "local")
MLPS = ("plain", "gated")
FREQ_DTYPES = ("float64", "float32")
# Fields added for the Llama family: left out of to_dict() while at their defaults, so that
# the config.json of a model without them is what it always was (a run saved before them
# resumes, its config unchanged).
_LLM_DEFAULTS: dict[str, object] = {
    "num_kv_heads": None, "norm": "layer", "norm_offset": 0.0, "mlp": "plain",
    "qkv_bias": None, "out_bias": None, "mlp_bias": None, "qk_norm": False,
    "sandwich_norm": False, "embed_scale": None, "attn_scale": None, "attn_softcap": None,
    "final_softcap": None, "layer_types": None, "rotary_local_base": None,
    "rotary_scaling": None, "rotary_freq_dtype": "float64",
}


def _optional_positive(name: str, value: object) -> None:
    if value is None:
        return
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value <= 0):
        raise ValueError(f"{name} must be None or a positive finite number, got {value!r}")


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
        num_kv_heads: key/value heads (grouped-query attention; 1 = multi-query); must
            divide ``num_heads``. None: ``num_heads``.
        head_dim: per-head dim ``D``; None: ``d_model // num_heads`` (resolved on creation,
            so after it this is always an int).
        norm: ``"layer"`` (LayerNorm) or ``"rms"`` (RMSNorm, no bias) for every norm.
        norm_offset: RMSNorm weight offset (Gemma: 1.0, its scale is ``1 + w``); also used by
            the QK-norms.
        mlp: ``"plain"`` (``linear2(act(linear1(x)))``) or ``"gated"``
            (``down(act(gate(x)) * up(x))``).
        qkv_bias, out_bias, mlp_bias: biases of the q/k/v, output and MLP projections
            (None: ``bias``).
        qk_norm: RMSNorm over each head's q and k before RoPE (eps ``layer_norm_eps``).
        sandwich_norm: also a norm on the attention output and on the MLP output before
            each is added to the residual (Gemma 2/3; needs ``norm_first``).
        embed_scale: multiply the token embeddings by this, rounded to the model dtype
            (Gemma: ``sqrt(d_model)``); None: no scaling.
        attn_scale: softmax scale (None: ``1 / sqrt(head_dim)``; Gemma:
            ``query_pre_attn_scalar ** -0.5``).
        attn_softcap: attention-logit soft-cap ``c * tanh(s / c)`` (Gemma 2); None: none.
        final_softcap: the same on the output logits; None: none.
        layer_types: per layer ``"full"`` or ``"local"`` (a sliding-window layer:
            ``LocalAttention(window_size, causal=True)``); None: every layer has
            ``attention``. With it ``attention`` stays ``"full"``. A Hugging Face
            ``sliding_window = W`` is ``window_size = 2 * W - 1``.
        rotary_local_base: RoPE base of the local layers, unscaled (Gemma 3: 10,000 beside
            1,000,000 for its global layers); None: they use ``rotary_base`` and
            ``rotary_scaling`` like the others.
        rotary_scaling: RoPE scaling of the (global) layers, ``{"rope_type": "linear",
            "factor": f}`` or ``{"rope_type": "llama3", "factor", "low_freq_factor",
            "high_freq_factor", "original_max_position_embeddings"}``; None: none.
        rotary_freq_dtype: ``"float64"`` (handformer's own models) or ``"float32"``: the
            RoPE frequencies computed as Meta's and Hugging Face's code does (what a
            pretrained checkpoint expects, to the last bit).

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
    num_kv_heads: int | None = None
    head_dim: int | None = None
    norm: str = "layer"
    norm_offset: float = 0.0
    mlp: str = "plain"
    qkv_bias: bool | None = None
    out_bias: bool | None = None
    mlp_bias: bool | None = None
    qk_norm: bool = False
    sandwich_norm: bool = False
    embed_scale: float | None = None
    attn_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    layer_types: list[str] | None = None
    rotary_local_base: float | None = None
    rotary_scaling: dict | None = None
    rotary_freq_dtype: str = "float64"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_len", "d_model", "num_heads", "num_layers", "d_ff"):
            check_positive_int(name, getattr(self, name))
        if self.head_dim is None:
            if self.d_model % self.num_heads:
                raise ValueError(f"d_model={self.d_model} is not divisible by "
                                 f"num_heads={self.num_heads}")
            self.head_dim = self.d_model // self.num_heads
        check_positive_int("head_dim", self.head_dim)
        if self.num_kv_heads is not None:
            check_positive_int("num_kv_heads", self.num_kv_heads)
            if self.num_heads % self.num_kv_heads:
                raise ValueError(f"num_kv_heads={self.num_kv_heads} must divide "
                                 f"num_heads={self.num_heads}")
        check_dropout("dropout", self.dropout)
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, "
                             f"got {self.activation!r}")
        if self.positional not in POSITIONALS:
            raise ValueError(f"positional must be one of {list(POSITIONALS)}, "
                             f"got {self.positional!r}")
        if self.positional == "rotary" and self.head_dim % 2:
            raise ValueError(f"positional='rotary' needs an even head dim, got head_dim="
                             f"{self.head_dim}" + ("" if self.head_dim * self.num_heads
                                                   != self.d_model else
                                                   f" (d_model={self.d_model} / num_heads="
                                                   f"{self.num_heads})"))
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {list(ATTENTIONS)}, "
                             f"got {self.attention!r}")
        self._check_layer_types()
        uses_local = self.attention == "local" or "local" in (self.layer_types or ())
        for name, kind in (("window_size", "local"), ("stride", "strided")):
            value = getattr(self, name)
            if kind == "local" and uses_local:
                check_window_size(value)  # odd: an even window would act as the next odd one
            elif self.attention == kind:
                check_positive_int(name, value)
            elif value is not None:
                raise ValueError(f"{name}={value!r} is only used with attention={kind!r}, "
                                 f"not attention={self.attention!r}; leave it None")
        for name in ("tie_weights", "norm_first", "bias", "qk_norm", "sandwich_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("qkv_bias", "out_bias", "mlp_bias"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be None (= bias), True or False, got {value!r}")
        self._check_llm_fields()
        for name in ("layer_norm_eps", "rotary_base"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.rotary_base <= 1:
            raise ValueError(f"rotary_base must be > 1, got {self.rotary_base!r}")

    def _check_layer_types(self) -> None:
        if self.layer_types is None:
            return
        if not isinstance(self.layer_types, (list, tuple)) or \
                len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types must be a list of num_layers={self.num_layers} "
                             f"entries, got {self.layer_types!r:.120}")
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES}, key=repr)
        if bad:
            raise ValueError(f"layer_types entries must be one of {list(LAYER_TYPES)}, got "
                             f"{bad[0]!r}")
        if self.attention != "full":
            raise ValueError(f"layer_types sets each layer's attention; leave attention='full'"
                             f", got attention={self.attention!r}")
        self.layer_types = list(self.layer_types)

    def _check_llm_fields(self) -> None:
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {list(NORMS)}, got {self.norm!r}")
        if (isinstance(self.norm_offset, bool) or not isinstance(self.norm_offset, (int, float))
                or not math.isfinite(self.norm_offset)):
            raise ValueError(f"norm_offset must be a finite number, got {self.norm_offset!r}")
        if self.norm_offset and self.norm != "rms":
            raise ValueError(f"norm_offset={self.norm_offset!r} applies to norm='rms' only, "
                             f"not norm={self.norm!r}")
        if self.mlp not in MLPS:
            raise ValueError(f"mlp must be one of {list(MLPS)}, got {self.mlp!r}")
        if self.sandwich_norm and not self.norm_first:
            raise ValueError("sandwich_norm=True needs norm_first=True (pre-norm layers with a "
                             "norm on each sublayer's output too)")
        for name in ("embed_scale", "attn_scale", "attn_softcap", "final_softcap"):
            _optional_positive(name, getattr(self, name))
        if self.attn_softcap is not None and self.attention not in ("full", "local"):
            raise ValueError(f"attn_softcap applies to softmax attention ('full', 'local'), not "
                             f"attention={self.attention!r}")
        if self.rotary_freq_dtype not in FREQ_DTYPES:
            raise ValueError(f"rotary_freq_dtype must be one of {list(FREQ_DTYPES)}, got "
                             f"{self.rotary_freq_dtype!r}")
        for name in ("rotary_local_base", "rotary_scaling"):
            if getattr(self, name) is not None and self.positional != "rotary":
                raise ValueError(f"{name} is only used with positional='rotary', not "
                                 f"positional={self.positional!r}; leave it None")
        if self.rotary_local_base is not None:
            base = self.rotary_local_base
            if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 1:
                raise ValueError(f"rotary_local_base must be None or a number > 1, got "
                                 f"{base!r}")
        check_rotary_scaling(self.rotary_scaling)

    def layer_type(self, i: int) -> str:
        """Layer ``i``'s attention: ``"full"`` or ``"local"`` (from ``layer_types``), else
        ``attention`` (``"full"``, ``"local"``, ``"strided"``, ``"linear"``)."""
        if not 0 <= i < self.num_layers:
            raise ValueError(f"layer {i} out of range: the model has {self.num_layers} layers")
        return self.attention if self.layer_types is None else self.layer_types[i]

    def to_dict(self) -> dict:
        """The fields as a JSON-ready dict (the Llama-family fields only where they are set,
        and ``head_dim`` only when it is not ``d_model // num_heads``)."""
        data = asdict(self)
        for name, default in _LLM_DEFAULTS.items():
            if data[name] == default and type(data[name]) is type(default):
                del data[name]
        if self.head_dim * self.num_heads == self.d_model:
            del data["head_dim"]
        return data

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

    def make_attention(self, layer: int | None = None) -> AttentionKind:
        """A fresh instance of the attention kind of ``layer`` (None: ``attention``'s).

        A ``layer_types`` local layer is ``LocalAttention(window_size, causal=True)``; the
        soft-cap ``attn_softcap`` goes into the softmax kinds.
        """
        kind = self.attention if layer is None else self.layer_type(layer)
        if kind == "full":
            return FullAttention(softcap=self.attn_softcap)
        if kind == "local":
            from handformer.attention.local import LocalAttention

            return LocalAttention(self.window_size, causal=self.layer_types is not None,
                                  softcap=self.attn_softcap)
        if kind == "strided":
            from handformer.attention.sparse import StridedAttention

            return StridedAttention(self.stride)
        from handformer.attention.linear import LinearAttention

        return LinearAttention()
