"""The local replacement model of one prompt: a causal LM made linear in its sources.

Given a model, one transcoder per layer and a prompt, the real forward pass is run once and
its non-linear parts are frozen at what they were on that prompt:

- every norm's divisor (the ``hook_scale`` points: ``ln1``, ``ln2``, the sandwich norms
  ``ln1_post``/``ln2_post``, the QK-norms, ``ln_final``),
- every attention pattern (``hook_pattern``: the softmax, soft-cap and mask),
- each MLP is replaced by its transcoder, with the feature activations held at their real
  values and an *error* ``mlp_out − transcoder(mlp_in)`` per (layer, position) added back,
  so the replacement's output is the model's own on this prompt.

What stays is linear: the token embeddings, the features' decoder rows, the errors go through
the residual stream, norms with a fixed divisor (``(x − mean)/scale · w + b``), the frozen
attention's OV circuit (``pattern @ (x W_V + b_V) W_O + b_O``), a transcoder's skip term
``x @ W_skip`` and its encoder (a feature's *pre-activation*), the LM head. So every target
(a feature's pre-activation, a logit before any soft-cap) is ``Σ_sources edge + constant``.

Where a transcoder reads and writes: it reads the MLP's input ``blocks.{i}.mlp.hook_in`` (after
``ln2``) and replaces ``blocks.{i}.hook_mlp_out`` — for sandwich-norm models (Gemma) that is
*after* ``ln2_post``, so the post-MLP norm lies inside what the transcoder and its error
replace; its scale is frozen anyway, as every ``hook_scale`` is. A layer given ``None`` has no
transcoder: its whole MLP output is the error node.

Shape letters: ``B`` batch (copies of the prompt), ``L`` positions, ``E`` model width,
``F`` features, ``V`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from handformer.features.dictionary import Transcoder
from handformer.inspect.run import hooks, run_with_cache

__all__ = ["ReplacementModel", "ReplacementOutput", "per_layer", "check_transcoders"]


def per_layer(transcoders: Any, n_layers: int) -> list[Transcoder | None]:
    """One transcoder (or None) per layer, from a list or a ``{layer: transcoder}`` mapping.

    Args:
        transcoders: the list or mapping.
        n_layers: the model's layers.

    Raises:
        ValueError: for a list of another length, a layer out of range, a non-transcoder.
    """
    if isinstance(transcoders, Mapping):
        out: list[Transcoder | None] = [None] * n_layers
        for layer, tc in transcoders.items():
            if not isinstance(layer, int) or not 0 <= layer < n_layers:
                raise ValueError(f"transcoders: layer {layer!r} is not in 0..{n_layers - 1}")
            out[layer] = tc
    elif isinstance(transcoders, Sequence) and not isinstance(transcoders, str):
        if len(transcoders) != n_layers:
            raise ValueError(f"transcoders: {len(transcoders)} given for a model of "
                             f"{n_layers} layers (pass one per layer, None for none)")
        out = list(transcoders)
    else:
        raise ValueError(f"transcoders must be a list (one per layer) or a mapping "
                         f"{{layer: Transcoder}}, got {type(transcoders).__name__}")
    for i, tc in enumerate(out):
        if tc is not None and not isinstance(tc, Transcoder):
            raise ValueError(f"transcoders[{i}] must be a Transcoder or None, got "
                             f"{type(tc).__name__}")
    return out


def check_transcoders(model: nn.Module, transcoders: Any) -> list[Transcoder | None]:
    """:func:`per_layer`, and every transcoder reads and writes the model's width.

    Args:
        model: the causal LM (its ``blocks`` and ``lm_head``).
        transcoders: a list (one per layer) or a ``{layer: transcoder}`` mapping.

    Returns:
        One transcoder (or None) per layer.

    Raises:
        ValueError: as :func:`per_layer`, or naming a transcoder of another width.
    """
    out = per_layer(transcoders, len(model.blocks))
    width = model.lm_head.in_features
    for i, tc in enumerate(out):
        if tc is not None and (tc.d_in != width or tc.d_out != width):
            raise ValueError(f"transcoders[{i}] has d_in = {tc.d_in}, d_out = {tc.d_out}; "
                             f"the model's MLP input and output have width {width}")
    return out


@dataclass
class ReplacementOutput:
    """What one run of the replacement computed (``B`` copies of the prompt).

    Attributes:
        logits: ``(B, L, V)`` before any final soft-cap (None from ``run(logits=False)``).
        final: ``(B, L, E)`` what the LM head reads (the final norm's output).
        pre: per layer ``(B, L, F)`` feature pre-activations (None without a transcoder).
        mlp_in: per layer ``(B, L, E)`` the MLP's input in this run.
        captured: hook name -> the value seen there (the names asked for in ``capture``).
    """

    logits: Tensor | None
    pre: list[Tensor | None]
    mlp_in: list[Tensor]
    captured: dict[str, Tensor]
    final: Tensor


class ReplacementModel:
    """A model's local replacement on one prompt (see the module docs).

    Args:
        model: a handformer ``CausalLM`` (anything with ``layers`` of DecoderLayers, an
            ``lm_head`` and handformer's hook points).
        transcoders: one :class:`Transcoder` per layer (None: no transcoder), a list or a
            ``{layer: transcoder}`` mapping.
        ids: ``(L,)`` or ``(1, L)`` token ids of the prompt.

    Raises:
        ValueError: for a batch of several prompts, a transcoder that does not fit.

    Attributes:
        ids: ``(L,)`` the prompt.
        transcoders: per layer.
        frozen: hook name -> the value frozen there (norm scales, patterns), ``(1, ...)``.
        embed: ``(1, L, E)`` the token embeddings (``hook_embed``) of the real run.
        acts: per layer ``(1, L, F)`` the real feature activations (None without transcoder).
        errors: ``(n_layers, 1, L, E)`` the real ``mlp_out − reconstruction``.
        scales: per layer the transcoder's input scaling ``s`` of the real run (or None).
        logits: ``(1, L, V)`` the real pre-soft-cap logits.
    """

    def __init__(self, model: nn.Module, transcoders: Any, ids: Tensor) -> None:
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2 or ids.shape[0] != 1:
            raise ValueError(f"ids must be (L,) or (1, L): one prompt, got shape "
                             f"{tuple(ids.shape)}")
        self.model = model
        self.ids = ids[0]
        self.layers = list(model.blocks)
        self.n_layers = len(self.layers)
        self.transcoders = check_transcoders(model, transcoders)
        self.final_name = ("ln_final.hook_normalized"
                           if getattr(model, "ln_final", None) is not None
                           else f"blocks.{self.n_layers - 1}.hook_resid_post")
        mlp_in: dict[int, Tensor] = {}
        handles = [layer.mlp.register_forward_pre_hook(
            lambda module, args, i=i: mlp_in.__setitem__(i, args[0].detach()))
            for i, layer in enumerate(self.layers)]
        try:
            with torch.no_grad():
                _, cache = run_with_cache(model, ids, names=lambda n: n.endswith(
                    ("hook_scale", "hook_pattern", "hook_mlp_out")) or n in (
                    "hook_embed", self.final_name))
        finally:
            for handle in handles:
                handle.remove()
        self.frozen = {n: t for n, t in cache.items()
                       if n.endswith(("hook_scale", "hook_pattern"))}
        self.embed = cache["hook_embed"]
        self.mlp_in_real = [mlp_in[i] for i in range(self.n_layers)]
        dtype = self.embed.dtype
        with torch.no_grad():
            self.logits = model.lm_head(cache[self.final_name])  # (1, L, V) before soft-cap
            self.scales: list[Tensor | None] = []
            self.acts: list[Tensor | None] = []
            errors = []
            for i, tc in enumerate(self.transcoders):
                out = cache[f"blocks.{i}.hook_mlp_out"]  # (1, L, E)
                if tc is None:
                    self.scales.append(None)
                    self.acts.append(None)
                    errors.append(out)
                    continue
                x = self.mlp_in_real[i].to(tc.dtype)
                s = tc.scale(x)
                acts = tc.activate(tc.pre_activation(x, s))  # (1, L, F)
                self.scales.append(s)
                self.acts.append(acts)
                errors.append(out - tc.reconstruct(x, acts, s).to(dtype))
        self.errors = torch.stack(errors)  # (n_layers, 1, L, E)

    def run(self, embed: Tensor | None = None, acts: Sequence[Tensor | None] | None = None,
            errors: Tensor | None = None, *, capture: Sequence[str] = (),
            logits: bool = True) -> ReplacementOutput:
        """Run the frozen replacement on given sources (default: the real ones).

        Every source may carry a batch of ``B`` copies (the same ``B`` for all), and may
        require grad: the run is linear in them.

        Args:
            embed: ``(B, L, E)`` token embeddings in place of ``hook_embed``.
            acts: per layer ``(B, L, F)`` feature activations (None entries where the layer
                has no transcoder).
            errors: ``(n_layers, B, L, E)`` error nodes.
            capture: hook names whose values to keep (``blocks.2.attn.hook_rot_q``).
            logits: apply the LM head (``(B, L, V)``); False leaves ``logits`` None, for a
                caller that reads a few logits from ``final`` (the full product, and its
                gradient in a batched backward pass, cost most of a graph's time on a large
                vocabulary).

        Returns:
            A :class:`ReplacementOutput`.
        """
        embed = self.embed if embed is None else embed
        acts = self.acts if acts is None else acts
        errors = self.errors if errors is None else errors
        # one view per layer (a single backward node: indexing errors[i] in each layer would
        # give every layer's gradient the whole (n_layers, B, L, E) shape to fill and add)
        per_layer_errors = errors.unbind(0)
        B = embed.shape[0]
        pre: list[Tensor | None] = [None] * self.n_layers
        mlp_in: list[Tensor | None] = [None] * self.n_layers
        final: list[Tensor] = []

        def freeze(t: Tensor, name: str) -> Tensor:
            return self.frozen[name].expand(t.shape)  # the real run's value, no gradient

        def set_embed(t: Tensor, name: str) -> Tensor:
            return embed

        def mlp_out(i: int) -> Any:
            def fn(t: Tensor, name: str) -> Tensor:
                tc, x = self.transcoders[i], mlp_in[i]
                if tc is None:
                    return per_layer_errors[i]
                s = self.scales[i]
                if s is not None and s.dim() > 0:
                    s = s.expand(B, *s.shape[1:])  # (B, L, 1)
                xt = x.to(tc.dtype)
                pre[i] = tc.pre_activation(xt, s)  # (B, L, F)
                return tc.reconstruct(xt, acts[i], s).to(t.dtype) + per_layer_errors[i]
            return fn

        def keep_final(t: Tensor, name: str) -> None:
            final.append(t)

        spec: dict[str, Any] = {name: freeze for name in self.frozen}
        spec["hook_embed"] = set_embed
        spec[self.final_name] = keep_final
        captured: dict[str, Tensor] = {}
        for name in capture:
            spec[name] = lambda t, n: captured.__setitem__(n, t)
        for i in range(self.n_layers):
            spec[f"blocks.{i}.hook_mlp_out"] = mlp_out(i)
        handles = [layer.mlp.register_forward_pre_hook(
            lambda module, args, i=i: mlp_in.__setitem__(i, args[0]))
            for i, layer in enumerate(self.layers)]
        try:
            with hooks(self.model, spec):
                self.model(self.ids[None].expand(B, -1))
        finally:
            for handle in handles:
                handle.remove()
        out = self.model.lm_head(final[0]) if logits else None  # (B, L, V) before soft-cap
        return ReplacementOutput(out, pre, mlp_in, captured, final[0])  # type: ignore[arg-type]
