"""TransformerLens' weight names, as read-only views of the real parameters.

Shape letters: ``E`` model dim (``d_model``), ``H`` query heads, ``H_kv`` key/value heads,
``D`` head dim, ``F`` MLP hidden dim (``d_mlp``), ``V`` vocabulary, ``N`` context.

A TransformerLens user reaches for ``model.W_E``, ``model.blocks[3].attn.W_Q``,
``model.cfg.n_heads``. Here they are properties over the modules' own parameters, in
TransformerLens' shapes, computed by ``view`` / ``transpose`` only: no copy (they share the
parameters' memory, packed q/k/v included), nothing registered a second time
(``model.parameters()`` and ``named_modules()`` are what they were), and none can be
assigned. Writing into one writes into the model (under ``torch.no_grad()``).

============================  ==================  ===========================================
view                          shape               of
============================  ==================  ===========================================
``W_E``                       ``(V, E)``          ``tok_emb.weight`` (before ``embed_scale``)
``W_U`` / ``b_U``             ``(E, V)`` / (V,)   ``lm_head.weight.T`` / zeros (no bias)
``W_pos``                     ``(N, E)``          ``pos_emb.weight`` (learned positions), or
                                                  the sinusoidal table; rotary: refused
``attn.W_Q`` / ``b_Q``        ``(H, E, D)`` / ``(H, D)``          ``q_proj``
``attn.W_K``, ``W_V`` / b     ``(H_kv, E, D)`` / ``(H_kv, D)``    ``k_proj``, ``v_proj``
``attn.W_O`` / ``b_O``        ``(H, D, E)`` / ``(E,)``            ``out_proj``
``mlp.W_in`` / ``b_in``       ``(E, F)`` / ``(F,)``   ``linear1`` (``up_proj`` when gated)
``mlp.W_gate``                ``(E, F)``          ``gate_proj`` (gated MLPs only)
``mlp.W_out`` / ``b_out``     ``(F, E)`` / ``(E,)``   ``linear2`` (``down_proj``)
``cfg``                       --                  ``config``, TransformerLens' field names
============================  ==================  ===========================================

A bias the model does not have reads as zeros (a new tensor, as TransformerLens' zero
biases), so ``x @ W_Q + b_Q`` holds for every model. Grouped-query attention: ``W_K`` and
``W_V`` keep their ``H_kv`` heads, as the model stores them, where TransformerLens' expand
them to ``H`` (query head ``h`` reads key/value head ``h // (H / H_kv)``); the expanded
form, a copy, is :meth:`AttentionViews.expanded_W_K` (and ``_W_V``, ``_b_K``, ``_b_V``).

Also unlike TransformerLens: ``hook_q``, ``hook_k``, ``hook_v`` are ``(B, H, L, D)`` here,
``(B, L, H, D)`` there (``hook_z`` is ``(B, L, H, D)`` in both).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

__all__ = ["AttentionViews", "MLPViews", "GatedMLPViews", "CausalLMViews", "TLConfig"]


class ReadOnlyViews:
    """Refuses to assign the names in ``_VIEW_SOURCES`` (a view's name -> what it views)."""

    _VIEW_SOURCES: ClassVar[dict[str, str]] = {}

    def __setattr__(self, name: str, value: Any) -> None:
        source = type(self)._VIEW_SOURCES.get(name)
        if source is not None:
            raise AttributeError(f"{type(self).__name__}.{name} is a read-only view of "
                                 f"{source}; assign or write into {source} itself")
        super().__setattr__(name, value)


def _zeros(like: Tensor, *shape: int) -> Tensor:
    """The zero bias of a layer without one, on ``like``'s dtype and device."""
    return torch.zeros(shape, dtype=like.dtype, device=like.device)


def _view(weight: Tensor) -> Tensor:
    """``weight`` as a plain tensor sharing its memory (not the Parameter itself, so that it
    is never registered by accident in another module)."""
    return weight.view(weight.shape)


class AttentionViews(ReadOnlyViews):
    """``W_Q W_K W_V W_O b_Q b_K b_V b_O`` of a :class:`~handformer.MultiHeadAttention`."""

    _VIEW_SOURCES: ClassVar[dict[str, str]] = {
        "W_Q": "q_proj.weight", "W_K": "k_proj.weight", "W_V": "v_proj.weight",
        "W_O": "out_proj.weight", "b_Q": "q_proj.bias", "b_K": "k_proj.bias",
        "b_V": "v_proj.bias", "b_O": "out_proj.bias"}

    def _in(self, linear: nn.Linear, heads: int) -> Tensor:
        """``(heads * D, E)`` -> ``(heads, E, D)``: TransformerLens' W_Q/W_K/W_V."""
        w = linear.weight
        return w.view(heads, self.head_dim, w.shape[1]).transpose(1, 2)  # (heads, E, D)

    def _bias(self, linear: nn.Linear, heads: int) -> Tensor:
        if linear.bias is None:
            return _zeros(linear.weight, heads, self.head_dim)
        return linear.bias.view(heads, self.head_dim)  # (heads, D)

    @property
    def W_Q(self) -> Tensor:  # noqa: N802 - TransformerLens' name
        """``(H, E, D)``: ``q = x @ W_Q + b_Q`` per head."""
        return self._in(self.q_proj, self.num_heads)

    @property
    def W_K(self) -> Tensor:  # noqa: N802
        """``(H_kv, E, D)``: the ``H_kv`` key heads (TransformerLens expands them to ``H``:
        :meth:`expanded_W_K`)."""
        return self._in(self.k_proj, self.num_kv_heads)

    @property
    def W_V(self) -> Tensor:  # noqa: N802
        """``(H_kv, E, D)``: the ``H_kv`` value heads (expanded: :meth:`expanded_W_V`)."""
        return self._in(self.v_proj, self.num_kv_heads)

    @property
    def W_O(self) -> Tensor:  # noqa: N802
        """``(H, D, E)``: the output is ``sum_h z_h @ W_O[h] + b_O``."""
        w = self.out_proj.weight  # (E, H * D)
        return w.view(w.shape[0], self.num_heads, self.head_dim).permute(1, 2, 0)  # (H, D, E)

    @property
    def b_Q(self) -> Tensor:
        """``(H, D)`` (zeros without a bias)."""
        return self._bias(self.q_proj, self.num_heads)

    @property
    def b_K(self) -> Tensor:
        """``(H_kv, D)`` (zeros without a bias)."""
        return self._bias(self.k_proj, self.num_kv_heads)

    @property
    def b_V(self) -> Tensor:
        """``(H_kv, D)`` (zeros without a bias)."""
        return self._bias(self.v_proj, self.num_kv_heads)

    @property
    def b_O(self) -> Tensor:
        """``(E,)`` (zeros without a bias)."""
        bias = self.out_proj.bias
        return _zeros(self.out_proj.weight, self.out_proj.weight.shape[0]) if bias is None \
            else _view(bias)

    def _expand(self, t: Tensor) -> Tensor:
        """``(H_kv, ...)`` -> ``(H, ...)``: each key/value head repeated for its query group."""
        return t.repeat_interleave(self.num_heads // self.num_kv_heads, dim=0)  # (H, ...)

    def expanded_W_K(self) -> Tensor:  # noqa: N802
        """``(H, E, D)``: :attr:`W_K` with one key head per query head, TransformerLens'
        ``W_K`` (a copy when ``H_kv < H``)."""
        return self._expand(self.W_K)

    def expanded_W_V(self) -> Tensor:  # noqa: N802
        """``(H, E, D)``: :attr:`W_V` expanded as :meth:`expanded_W_K`."""
        return self._expand(self.W_V)

    def expanded_b_K(self) -> Tensor:
        """``(H, D)``: :attr:`b_K` expanded as :meth:`expanded_W_K`."""
        return self._expand(self.b_K)

    def expanded_b_V(self) -> Tensor:
        """``(H, D)``: :attr:`b_V` expanded as :meth:`expanded_W_K`."""
        return self._expand(self.b_V)


class MLPViews(ReadOnlyViews):
    """``W_in b_in W_out b_out`` of a :class:`~handformer.FeedForward`
    (``out = act(x @ W_in + b_in) @ W_out + b_out``)."""

    _VIEW_SOURCES: ClassVar[dict[str, str]] = {
        "W_in": "linear1.weight", "b_in": "linear1.bias", "W_out": "linear2.weight",
        "b_out": "linear2.bias"}
    _IN, _OUT = "linear1", "linear2"

    @property
    def W_in(self) -> Tensor:  # noqa: N802
        """``(E, F)``."""
        return getattr(self, self._IN).weight.T  # (E, F)

    @property
    def b_in(self) -> Tensor:
        """``(F,)`` (zeros without a bias)."""
        linear = getattr(self, self._IN)
        return _zeros(linear.weight, linear.weight.shape[0]) if linear.bias is None \
            else _view(linear.bias)

    @property
    def W_out(self) -> Tensor:  # noqa: N802
        """``(F, E)``."""
        return getattr(self, self._OUT).weight.T  # (F, E)

    @property
    def b_out(self) -> Tensor:
        """``(E,)`` (zeros without a bias)."""
        linear = getattr(self, self._OUT)
        return _zeros(linear.weight, linear.weight.shape[0]) if linear.bias is None \
            else _view(linear.bias)


class GatedMLPViews(MLPViews):
    """``W_gate W_in b_in W_out b_out`` of a :class:`~handformer.layers.GatedFeedForward`
    (``out = (act(x @ W_gate) * (x @ W_in + b_in)) @ W_out + b_out``, TransformerLens'
    ``GatedMLP``)."""

    _VIEW_SOURCES: ClassVar[dict[str, str]] = {
        "W_in": "up_proj.weight", "b_in": "up_proj.bias", "W_gate": "gate_proj.weight",
        "W_out": "down_proj.weight", "b_out": "down_proj.bias"}
    _IN, _OUT = "up_proj", "down_proj"

    @property
    def W_gate(self) -> Tensor:  # noqa: N802
        """``(E, F)``."""
        return self.gate_proj.weight.T  # (E, F)


_ACT_FN = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new", "silu": "silu"}
_POSITIONAL = {"learned": "standard", "rotary": "rotary", "sinusoidal": "sinusoidal"}


class TLConfig:
    """A read-only view of a :class:`~handformer.CausalLMConfig` with TransformerLens'
    field names, where they mean the same thing.

    ``n_layers n_heads d_model d_head d_vocab d_vocab_out n_ctx n_key_value_heads d_mlp act_fn
    normalization_type eps positional_embedding_type rotary_base rotary_dim gated_mlp``.
    ``n_key_value_heads`` is always a number (TransformerLens: None without grouped-query
    attention, meaning ``n_heads``); ``act_fn`` is ``"gelu_new"`` for the tanh GELU;
    ``normalization_type`` is ``"LN"`` or ``"RMS"`` (also for post-norm models, which
    TransformerLens does not have); ``positional_embedding_type`` ``"standard"`` (learned),
    ``"rotary"``, or ``"sinusoidal"`` (handformer's own). The model's own names are on
    ``model.config``.
    """

    FIELDS = ("n_layers", "n_heads", "d_model", "d_head", "d_vocab", "d_vocab_out", "n_ctx",
              "n_key_value_heads", "d_mlp", "act_fn", "normalization_type", "eps",
              "positional_embedding_type", "rotary_base", "rotary_dim", "gated_mlp")

    def __init__(self, config: Any) -> None:
        object.__setattr__(self, "_config", config)

    def __getattr__(self, name: str) -> Any:
        c = self._config
        values = {
            "n_layers": c.num_layers, "n_heads": c.num_heads, "d_model": c.d_model,
            "d_head": c.head_dim, "d_vocab": c.vocab_size, "d_vocab_out": c.vocab_size,
            "n_ctx": c.max_len, "n_key_value_heads": c.num_kv_heads or c.num_heads,
            "d_mlp": c.d_ff, "act_fn": _ACT_FN.get(c.activation, c.activation),
            "normalization_type": "RMS" if c.norm == "rms" else "LN",
            "eps": c.layer_norm_eps,
            "positional_embedding_type": _POSITIONAL.get(c.positional, c.positional),
            "gated_mlp": c.mlp == "gated"}
        if c.positional == "rotary":
            values.update(rotary_base=c.rotary_base, rotary_dim=c.head_dim)
        if name in values:
            return values[name]
        have = ", ".join(f for f in self.FIELDS if f in values)
        raise AttributeError(f"model.cfg has no {name!r}: its TransformerLens fields are "
                             f"{have}; model.config has the model's own")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"model.cfg is a read-only view of model.config; cannot set "
                             f"{name!r}")

    def __dir__(self) -> list[str]:
        return list(self.FIELDS)

    def to_dict(self) -> dict[str, Any]:
        """The fields this model has, by TransformerLens' names."""
        out = {}
        for name in self.FIELDS:
            try:
                out[name] = getattr(self, name)
            except AttributeError:
                continue
        return out

    def __repr__(self) -> str:
        return f"TLConfig({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"


class CausalLMViews(ReadOnlyViews):
    """``W_E W_U b_U W_pos cfg`` of a :class:`~handformer.CausalLM` (``blocks`` is its own
    ``ModuleList``, ``blocks[i].attn`` and ``.mlp`` its real modules)."""

    _VIEW_SOURCES: ClassVar[dict[str, str]] = {
        "W_E": "tok_emb.weight", "W_U": "lm_head.weight", "b_U": "lm_head.bias",
        "W_pos": "pos_emb.weight", "cfg": "config"}

    @property
    def W_E(self) -> Tensor:  # noqa: N802
        """``(V, E)``: the token embedding table (before ``config.embed_scale``)."""
        return _view(self.tok_emb.weight)

    @property
    def W_U(self) -> Tensor:  # noqa: N802
        """``(E, V)``: ``logits = x @ W_U + b_U`` (before ``config.final_softcap``)."""
        return self.lm_head.weight.T  # (E, V)

    @property
    def b_U(self) -> Tensor:
        """``(V,)`` zeros: the LM head has no bias."""
        return _zeros(self.lm_head.weight, self.lm_head.weight.shape[0])

    @property
    def W_pos(self) -> Tensor:  # noqa: N802
        """``(N, E)``: the learned position embeddings (or the fixed sinusoidal table).

        Raises:
            AttributeError: for a model without a position table (rotary positions act on
                q and k inside each attention layer: ``hook_rot_q``, ``hook_rot_k``).
        """
        table = getattr(self.pos_emb, "weight", None)
        if table is None:
            table = getattr(self.pos_emb, "pe", None)
        if table is None:
            raise AttributeError(self._no_positions())
        return _view(table)

    def _no_positions(self) -> str:
        return (f"this model has no W_pos: its positions are {self.config.positional!r}, "
                "applied to q and k inside each attention layer (blocks.{i}.attn.hook_rot_q, "
                "hook_rot_k), not a table added to the embeddings")

    def __getattr__(self, name: str) -> Any:
        if name == "W_pos":  # the property raised: say why, not "no attribute"
            raise AttributeError(self._no_positions())
        return super().__getattr__(name)

    @property
    def cfg(self) -> TLConfig:
        """``config`` by TransformerLens' field names (read-only, see :class:`TLConfig`)."""
        return TLConfig(self.config)
