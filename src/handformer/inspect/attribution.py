"""Direct logit attribution on an :class:`~handformer.inspect.run.ActivationCache`.

The residual stream of a pre-norm decoder is a sum: the embeddings plus what every attention
and MLP sublayer added. The logit of token ``t`` reads that sum through the final norm and the
unembedding, and with the norm's divisor frozen at its cached value (``ln_final.hook_scale``)
the read is linear, so every piece of the sum gets its own share of the logit::

    logit_t = sum_c  center(x_c) / scale . (w_norm * W_U[t])  +  (b_norm . W_U[t] + b_U[t])
                     -- one component's attribution --           -- the "bias" term --

``center`` subtracts the mean over the features for LayerNorm (it is linear) and is the
identity for RMSNorm. handformer does not fold the norm's weight into the unembedding, so the
direction of a token is ``W_U[t] * w_norm`` (:func:`tokens_to_residual_directions`; ``1 + w``
for a norm with a unit offset, Gemma's), and the biases of the norm and of the unembedding are
one labelled ``"bias"`` term (:func:`logit_bias`, ``logit_attrs(..., incl_bias=True)``). The
attributions of :func:`decompose_resid` or :func:`stack_head_results` (with
``incl_remainder=True``) plus the bias term add up to the logit, or the logit difference,
up to float rounding.

Which methods add up, and which are lenses:

* :func:`decompose_resid` and :func:`stack_head_results` split the residual stream into
  parts that sum to it exactly (``incl_remainder`` gives the rest of the stream beside the
  heads: embeddings, MLPs, output biases). :func:`logit_attrs` of such a stack adds up.
* :func:`accumulated_resid` returns the residual stream *so far* at each depth; with
  ``apply_ln=True`` each entry is normalised with its own divisor (a logit lens): the entries
  are not parts of a sum and their attributions do not add up to anything.
* With sandwich norms (Gemma: a norm after each sublayer, ``ln1_post``), a head's result
  is taken through that norm with its divisor frozen at the cached value
  (``blocks.{l}.ln1_post.hook_scale``) times its weight, so the heads of a layer still add up
  to ``hook_attn_out``.
* With a soft-capped output (``final_softcap``: ``logits = cap * tanh(z / cap)``) the
  attributions are of ``z``, the logit before the cap: ``tanh`` is not linear, so a logit after
  the cap has no additive split; ``z`` keeps the order of the tokens (the cap is monotonic).

Shape letters: ``C`` components, ``N`` layers, ``B`` batch, ``L`` length (positions), ``H``
heads, ``D`` head dim, ``E`` model dim, ``V`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "accumulated_resid",
    "decompose_resid",
    "stack_head_results",
    "apply_ln_to_stack",
    "logit_attrs",
    "logit_bias",
    "tokens_to_residual_directions",
    "apply_pos_slice",
]

PosSlice = int | slice | Sequence[int] | Tensor | None
# An ActivationCache (handformer.inspect.run), which calls these functions from its methods:
# this module does not import it, so that the two do not import each other.
ActivationCache = Any
MODES = ("all", "attn", "mlp")


# ---- small helpers ---------------------------------------------------------------------------


def apply_pos_slice(t: Tensor, pos_slice: PosSlice, dim: int = -2) -> Tensor:
    """``t`` with ``pos_slice`` applied along the position dim ``dim``.

    ``None`` keeps every position, an int keeps one and drops the dim (as TransformerLens'
    ``Slice``), a ``slice`` or a list / tensor of indices keeps those.
    """
    if pos_slice is None:
        return t
    dim = dim % t.dim()
    if isinstance(pos_slice, bool):
        raise TypeError(f"pos_slice must be None, an int, a slice or indices, got {pos_slice!r}")
    if isinstance(pos_slice, int):
        return t.select(dim, pos_slice)
    if isinstance(pos_slice, slice):
        index: tuple[Any, ...] = (slice(None),) * dim + (pos_slice,)
        return t[index]
    idx = torch.as_tensor(pos_slice, dtype=torch.long, device=t.device)
    return t.index_select(dim, idx % t.shape[dim])


def _compute_dtype(t: Tensor) -> torch.dtype:
    """float32 at least: attributions are sums of many small terms."""
    return torch.promote_types(t.dtype, torch.float32)


def _model(cache: ActivationCache) -> nn.Module:
    """The cache's model, checked to be a causal LM with an additive residual stream."""
    model = cache.model
    if model is None or not hasattr(model, "blocks") or not hasattr(model, "lm_head"):
        raise TypeError(f"direct logit attribution needs a cache of a causal language model "
                        f"(CausalLM: layers, final norm, lm_head), got "
                        f"{type(model).__name__}; use run_with_cache(model, ...)")
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "norm_first", True) is False:
        raise ValueError("direct logit attribution needs a pre-norm model (norm_first=True): in "
                         "a post-norm model every layer renormalises the residual stream, so it "
                         "is not a sum of the sublayers' outputs")
    return model


def _norm_kind(norm: nn.Module) -> str:
    """``"layer"`` (centres, then divides) or ``"rms"`` (divides only)."""
    if isinstance(norm, nn.LayerNorm):
        return "layer"
    if type(norm).__name__ == "RMSNorm" or isinstance(norm, getattr(nn, "RMSNorm", ())):
        return "rms"
    raise TypeError(f"unsupported norm {type(norm).__name__}: attribution knows LayerNorm and "
                    "RMSNorm")


def _norm_weight(norm: nn.Module | None, like: Tensor) -> Tensor | None:
    """The norm's effective per-feature weight ``offset + weight`` ``(E,)``, or None (= 1)."""
    if norm is None:
        return None
    weight = getattr(norm, "weight", None)
    offset = float(getattr(norm, "offset", 0.0) or 0.0)
    if weight is None:
        return None if offset == 0.0 else torch.full(like.shape[-1:], offset, dtype=like.dtype,
                                                      device=like.device)
    return (weight.detach().to(like.device, like.dtype) + offset)


def _norm_eps(norm: nn.Module) -> float:
    eps = getattr(norm, "eps", None)
    return float(eps) if eps is not None else 1e-6


def _center(x: Tensor, kind: str) -> Tensor:
    return x - x.mean(-1, keepdim=True) if kind == "layer" else x


def _divisor(x: Tensor, norm: nn.Module) -> Tensor:
    """The norm's divisor of ``x`` ``(..., 1)``, recomputed: ``sqrt(var + eps)`` or
    ``sqrt(mean(x^2) + eps)``."""
    kind = _norm_kind(norm)
    x = x.to(_compute_dtype(x))
    if kind == "layer":
        return torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + _norm_eps(norm))
    return torch.sqrt(x.pow(2).mean(-1, keepdim=True) + _norm_eps(norm))


def _layer_index(cache: ActivationCache, layer: int | None, *, allow_end: bool = True) -> int:
    """``None`` / ``-1`` / ``N`` -> ``N`` (the stream before the unembedding); 0..N."""
    N = cache.num_layers
    if layer is None or layer == -1:
        return N
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= N:
        raise ValueError(f"layer must be in 0..{N} (or None / -1 for the stream before the "
                         f"unembedding), got {layer!r}")
    return layer


def _get(cache: ActivationCache, name: str, why: str) -> Tensor:
    if name in cache:
        return cache[name]
    raise KeyError(f"{why} needs {name!r} in the cache: run_with_cache(model, ...) without "
                   "names= keeps every hook point")


def _final_stream(cache: ActivationCache) -> Tensor:
    """The residual stream before the final norm ``(B, L, E)``."""
    return _get(cache, f"blocks.{cache.num_layers - 1}.hook_resid_post", "attribution")


def _norm_and_scale(cache: ActivationCache, layer: int, mlp_input: bool
                    ) -> tuple[nn.Module | None, str, str]:
    """The norm read at depth ``layer``, its ``hook_scale`` name and the stream it reads."""
    model = _model(cache)
    N = cache.num_layers
    if layer == N:
        return (getattr(model, "ln_final", None), "ln_final.hook_scale",
                f"blocks.{N - 1}.hook_resid_post")
    block = model.blocks[layer]
    if mlp_input:
        return block.ln2, f"blocks.{layer}.ln2.hook_scale", f"blocks.{layer}.hook_resid_mid"
    return block.ln1, f"blocks.{layer}.ln1.hook_scale", f"blocks.{layer}.hook_resid_pre"


def _stack_value(stack: Any) -> tuple[Tensor, list[str] | None]:
    """A stack, or a ``(stack, labels)`` pair as the ``return_labels=True`` methods return."""
    if isinstance(stack, tuple) and len(stack) == 2 and isinstance(stack[1], list):
        return stack[0], stack[1]
    if not isinstance(stack, Tensor):
        raise TypeError(f"stack must be a tensor (C, ..., E) or a (stack, labels) pair, got "
                        f"{type(stack).__name__}")
    return stack, None


def _result(stack: Tensor, labels: list[str], return_labels: bool) -> Any:
    return (stack, labels) if return_labels else stack


# ---- normalisation -----------------------------------------------------------------------


def apply_ln_to_stack(cache: ActivationCache, stack: Tensor, layer: int | None = None, *,
                      mlp_input: bool = False, pos_slice: PosSlice = None,
                      recompute: bool = False) -> Tensor:
    """Each entry of a residual stack centred (LayerNorm only) and divided by the norm's
    divisor, as the norm at depth ``layer`` sees it; the norm's weight and bias are not
    applied (the weight is in :func:`tokens_to_residual_directions`, the bias in
    :func:`logit_bias`).

    Args:
        cache: the cache of the run.
        stack: ``(C, B, L, E)`` (or with the positions already cut by ``pos_slice``).
        layer: ``None`` / ``-1`` / ``num_layers``: the final norm (``ln_final.hook_scale``);
            ``l``: the norm before layer ``l``'s attention (``blocks.{l}.ln1.hook_scale``) or,
            with ``mlp_input``, before its MLP (``ln2``).
        mlp_input: the MLP's norm of ``layer``.
        pos_slice: how ``stack``'s positions were cut (the cached divisor is cut alike).
        recompute: each entry divided by its own divisor (a lens, not additive) instead of
            the cached one of the real stream.

    Returns:
        The normalised stack, float32 at least.

    Raises:
        KeyError: when neither the divisor nor the stream it is computed from was cached.
    """
    layer = _layer_index(cache, layer)
    norm, scale_name, stream_name = _norm_and_scale(cache, layer, mlp_input)
    stack = stack.to(_compute_dtype(stack))
    if norm is None:  # a model without a final norm: the stream is read as it is
        return stack
    kind = _norm_kind(norm)
    if recompute:
        return _center(stack, kind) / _divisor(stack, norm)
    if scale_name in cache:
        scale = cache[scale_name]
    else:  # the same number, computed from the stream the norm read
        scale = _divisor(_get(cache, stream_name, "apply_ln_to_stack"), norm)
    scale = apply_pos_slice(scale.to(stack.dtype), pos_slice)  # (B, L', 1)
    return _center(stack, kind) / scale


# ---- stacks ----------------------------------------------------------------------------------


def accumulated_resid(cache: ActivationCache, layer: int | None = None, *,
                      incl_mid: bool = False, apply_ln: bool = False,
                      pos_slice: PosSlice = None, mlp_input: bool = False,
                      return_labels: bool = False) -> Any:
    """The residual stream so far at each depth: ``0_pre``, (``0_mid``,) ``1_pre``, ...,
    ``final_post``.

    A lens, not a decomposition: with ``apply_ln=True`` and ``layer`` the end, every entry is
    normalised by its own divisor (what the final norm would do if the model stopped there),
    so ``logit_attrs`` of it is a logit lens and does not add up.

    Args:
        cache: the cache of the run.
        layer: entries up to the input of layer ``layer`` (None / -1 / ``num_layers``: all,
            with ``final_post``).
        incl_mid: also ``{l}_mid`` (after the attention) of each earlier layer.
        apply_ln: normalise (see :func:`apply_ln_to_stack`).
        pos_slice: positions to keep (an int drops the dim).
        mlp_input: also ``{layer}_mid``, the MLP's input of ``layer``.
        return_labels: also return the labels.

    Returns:
        ``(C, B, L, E)``, or ``(stack, labels)``.
    """
    _model(cache)
    N = cache.num_layers
    layer = _layer_index(cache, layer)
    parts, labels = [], []
    for i in range(layer + 1):
        if i == N:
            parts.append(_get(cache, f"blocks.{N - 1}.hook_resid_post", "accumulated_resid"))
            labels.append("final_post")
            continue
        parts.append(_get(cache, f"blocks.{i}.hook_resid_pre", "accumulated_resid"))
        labels.append(f"{i}_pre")
        if (incl_mid and i < layer) or (mlp_input and i == layer):
            parts.append(_get(cache, f"blocks.{i}.hook_resid_mid", "accumulated_resid"))
            labels.append(f"{i}_mid")
    stack = torch.stack([apply_pos_slice(p, pos_slice) for p in parts])  # (C, B, L, E)
    if apply_ln:
        stack = apply_ln_to_stack(cache, stack, layer, mlp_input=mlp_input,
                                  pos_slice=pos_slice, recompute=layer == N)
    return _result(stack, labels, return_labels)


def _embed_parts(cache: ActivationCache) -> tuple[list[Tensor], list[str]]:
    """The embedding terms of the stream: ``embed`` (and ``pos_embed``)."""
    parts, labels = [_get(cache, "hook_embed", "decompose_resid")], ["embed"]
    if "hook_pos_embed" in cache:
        parts.append(cache["hook_pos_embed"])
        labels.append("pos_embed")
    return parts, labels


def decompose_resid(cache: ActivationCache, layer: int | None = None, *,
                    mlp_input: bool = False, mode: str = "all", apply_ln: bool = False,
                    pos_slice: PosSlice = None, incl_embeds: bool = True,
                    return_labels: bool = False) -> Any:
    """The residual stream at the input of ``layer`` as a sum of its parts: ``embed``,
    ``pos_embed``, ``{l}_attn_out``, ``{l}_mlp_out`` for every earlier layer ``l``.

    The parts add up to the stream exactly (``mode="all"``, ``incl_embeds=True``), so
    ``logit_attrs`` of them, plus the bias term, adds up to the logit.

    Args:
        cache: the cache of the run.
        layer: the stream at the input of this layer (None / -1 / ``num_layers``: before the
            unembedding).
        mlp_input: the stream at the input of ``layer``'s MLP (adds ``{layer}_attn_out``).
        mode: ``"all"``, ``"attn"`` (attention outputs only) or ``"mlp"`` (MLP outputs only).
        apply_ln: normalise with the cached divisor (see :func:`apply_ln_to_stack`).
        pos_slice: positions to keep (an int drops the dim).
        incl_embeds: include the embedding terms.
        return_labels: also return the labels.

    Returns:
        ``(C, B, L, E)``, or ``(stack, labels)``.

    Raises:
        ValueError: for an unknown mode, a layer out of range, a post-norm model.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    _model(cache)
    layer = _layer_index(cache, layer)
    parts: list[Tensor] = []
    labels: list[str] = []
    if incl_embeds:
        parts, labels = _embed_parts(cache)
    for i in range(layer + (1 if mlp_input else 0)):
        if mode != "mlp":
            parts.append(_get(cache, f"blocks.{i}.hook_attn_out", "decompose_resid"))
            labels.append(f"{i}_attn_out")
        if mode != "attn" and i < layer:
            parts.append(_get(cache, f"blocks.{i}.hook_mlp_out", "decompose_resid"))
            labels.append(f"{i}_mlp_out")
    if not parts:
        raise ValueError(f"decompose_resid(layer={layer}, mode={mode!r}, incl_embeds="
                         f"{incl_embeds}) selects no component")
    stack = torch.stack([apply_pos_slice(p, pos_slice) for p in parts])  # (C, B, L, E)
    if apply_ln:
        stack = apply_ln_to_stack(cache, stack, layer, mlp_input=mlp_input,
                                  pos_slice=pos_slice)
    return _result(stack, labels, return_labels)


def _head_results(cache: ActivationCache, layer: int, pos_slice: PosSlice) -> Tensor:
    """Each head's contribution to the residual stream at ``layer``, ``(B, L', H, E)``.

    ``blocks.{l}.attn.hook_result`` when cached, else ``hook_z`` times each head's slice of
    ``out_proj`` (the same numbers); with a post-attention norm, taken through it with its
    divisor frozen (cached ``ln1_post.hook_scale``, or recomputed from the heads' sum).
    """
    model = _model(cache)
    block = model.blocks[layer]
    attn = block.attn
    name = f"blocks.{layer}.attn.hook_result"
    if name in cache:
        result = apply_pos_slice(cache[name], pos_slice, dim=-3)  # (B, L', H, E)
        result = result.to(_compute_dtype(result))
    else:
        z = apply_pos_slice(_get(cache, f"blocks.{layer}.attn.hook_z", "stack_head_results"),
                            pos_slice, dim=-3)  # (B, L', H, D)
        dtype = _compute_dtype(z)
        H, D = z.shape[-2], z.shape[-1]
        w_o = attn.out_proj.weight.detach().to(z.device, dtype)  # (E, H*D)
        w_o = w_o.view(w_o.shape[0], H, D)  # (E, H, D)
        result = torch.einsum("...hd,ehd->...he", z.to(dtype), w_o)  # (B, L', H, E)
    post = getattr(block, "ln1_post", None)
    if post is None:
        return result
    kind = _norm_kind(post)
    scale_name = f"blocks.{layer}.ln1_post.hook_scale"
    if scale_name in cache:
        scale = apply_pos_slice(cache[scale_name], pos_slice).to(result.dtype)  # (B, L', 1)
    else:  # the post-norm's input is the heads' sum plus the output bias
        total = result.sum(-2)  # (B, L', E)
        if attn.out_proj.bias is not None:
            total = total + attn.out_proj.bias.detach().to(total)
        scale = _divisor(total, post)
    weight = _norm_weight(post, result)
    result = _center(result, kind) / scale[..., None, :]  # (B, L', H, E)
    return result if weight is None else result * weight


def stack_head_results(cache: ActivationCache, layer: int | None = None, *,
                       return_labels: bool = False, incl_remainder: bool = False,
                       pos_slice: PosSlice = None, apply_ln: bool = False) -> Any:
    """Every head's output in the residual stream, heads of the layers before ``layer``.

    Heads are labelled ``"L{l}H{h}"`` (query heads: with grouped-query attention each query
    head has its own output, its KV head is shared). The heads of one layer add up to that
    layer's ``hook_attn_out`` minus the output bias (through the frozen post-norm, if any).

    Args:
        cache: the cache of the run.
        layer: heads of layers ``0 .. layer - 1`` (None / -1 / ``num_layers``: all).
        return_labels: also return the labels.
        incl_remainder: append ``"remainder"``, the stream minus the heads (embeddings, MLPs,
            biases), so the stack adds up to the stream at ``layer``.
        pos_slice: positions to keep (an int drops the dim).
        apply_ln: normalise with the cached divisor (see :func:`apply_ln_to_stack`).

    Returns:
        ``(C, B, L, E)`` with ``C = layer * H`` (+1), or ``(stack, labels)``.
    """
    _model(cache)
    N = cache.num_layers
    layer = _layer_index(cache, layer)
    parts, labels = [], []
    for i in range(layer):
        result = _head_results(cache, i, pos_slice)  # (B, L', H, E)
        parts.append(result.movedim(-2, 0))  # (H, B, L', E)
        labels += [f"L{i}H{h}" for h in range(result.shape[-2])]
    if incl_remainder:
        name = (f"blocks.{N - 1}.hook_resid_post" if layer == N
                else f"blocks.{layer}.hook_resid_pre")
        stream = apply_pos_slice(_get(cache, name, "incl_remainder"), pos_slice)
        stream = stream.to(_compute_dtype(stream))
        heads = sum(p.sum(0) for p in parts) if parts else torch.zeros_like(stream)
        parts.append((stream - heads)[None])
        labels.append("remainder")
    if not parts:
        raise ValueError("stack_head_results(layer=0) without incl_remainder has no heads")
    stack = torch.cat(parts)  # (C, B, L', E)
    if apply_ln:
        stack = apply_ln_to_stack(cache, stack, layer, pos_slice=pos_slice)
    return _result(stack, labels, return_labels)


# ---- logits ----------------------------------------------------------------------------------


def _token_ids(tokens: Any, vocab: int, name: str) -> Tensor:
    if isinstance(tokens, str):
        raise TypeError(f"{name} must be token ids (an int or an integer tensor), got the text "
                        f"{tokens!r}; turn it into an id with the tokenizer first "
                        "(tokenizer.encode(text, add_special_tokens=False))")
    ids = torch.as_tensor(tokens)
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise TypeError(f"{name} must be integer token ids, got dtype {ids.dtype}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"{name} must be token ids in [0, {vocab}), got ids from "
                         f"{int(ids.min())} to {int(ids.max())}")
    return ids.long()


def tokens_to_residual_directions(model: nn.Module, tokens: Any) -> Tensor:
    """The residual direction of each token: ``W_U[t] * (offset + w)`` of the final norm.

    Args:
        model: a causal LM.
        tokens: an id, or an integer tensor of ids (any shape).

    Returns:
        ``tokens.shape + (E,)``, float32 at least.

    Raises:
        TypeError: for text or non-integer tokens. ValueError: for ids out of range.
    """
    head = model.lm_head.weight.detach()  # (V, E)
    ids = _token_ids(tokens, head.shape[0], "tokens").to(head.device)
    rows = head[ids].to(_compute_dtype(head))  # (..., E)
    weight = _norm_weight(getattr(model, "ln_final", None), rows)
    return rows if weight is None else rows * weight


def _bias_of(model: nn.Module, ids: Tensor) -> Tensor:
    """``b_norm . W_U[t] + b_U[t]`` for each id, ``ids.shape``."""
    head = model.lm_head
    dtype = _compute_dtype(head.weight)
    out = torch.zeros(ids.shape, dtype=dtype, device=head.weight.device)
    norm_bias = getattr(getattr(model, "ln_final", None), "bias", None)
    if norm_bias is not None:
        out = out + head.weight.detach()[ids].to(dtype) @ norm_bias.detach().to(dtype)
    if head.bias is not None:
        out = out + head.bias.detach()[ids].to(dtype)
    return out


def logit_bias(cache: ActivationCache, tokens: Any, incorrect_tokens: Any = None,
               pos_slice: PosSlice = None) -> Tensor:
    """The part of the logit (difference) no component owns: the final norm's bias through the
    unembedding, plus the unembedding's bias, ``b_norm . W_U[t] + b_U[t]``.

    Args:
        cache: the cache of the run.
        tokens: token id(s), as for :func:`logit_attrs`.
        incorrect_tokens: subtract their bias (a logit difference).
        pos_slice: unused (kept for the same call as :func:`logit_attrs`).

    Returns:
        A tensor of ``tokens``' shape.
    """
    model = _model(cache)
    V = model.lm_head.weight.shape[0]
    bias = _bias_of(model, _token_ids(tokens, V, "tokens").to(model.lm_head.weight.device))
    if incorrect_tokens is not None:
        wrong = _token_ids(incorrect_tokens, V, "incorrect_tokens")
        bias = bias - _bias_of(model, wrong.to(model.lm_head.weight.device))
    return bias


def logit_attrs(cache: ActivationCache, stack: Any, tokens: Any, incorrect_tokens: Any = None,
                pos_slice: PosSlice = None, *, incl_bias: bool = False) -> Any:
    """Each component's share of the logit of ``tokens`` (minus that of ``incorrect_tokens``).

    The stack is normalised here with the final norm's cached divisor (pass it raw, as
    :func:`decompose_resid` / :func:`stack_head_results` return it without ``apply_ln``), then
    dotted with :func:`tokens_to_residual_directions`.

    Args:
        cache: the cache of the run.
        stack: ``(C, B, L', E)``, or the ``(stack, labels)`` pair of ``return_labels=True``.
        tokens: an id (every position), ``(B,)`` (one per sequence, every position) or
            ``(B, L')`` ids.
        incorrect_tokens: ids of the same shape: attribute the logit difference.
        pos_slice: how the stack's positions were cut (an int: ``(C, B, E)``).
        incl_bias: append the ``"bias"`` term (:func:`logit_bias`) as the last row, so the
            rows add up to the logit (difference).

    Returns:
        ``(C, B, L')`` (``(C + 1, ...)`` with the bias), or ``(attrs, labels)`` when given a
        ``(stack, labels)`` pair.

    Raises:
        ValueError: for ``tokens`` and ``incorrect_tokens`` of different shapes, or ids that do
            not fit the stack's batch and positions.
    """
    model = _model(cache)
    values, labels = _stack_value(stack)
    scaled = apply_ln_to_stack(cache, values, None, pos_slice=pos_slice)  # (C, B, L', E)
    directions = tokens_to_residual_directions(model, tokens).to(scaled.device)
    if incorrect_tokens is not None:
        wrong = tokens_to_residual_directions(model, incorrect_tokens).to(scaled.device)
        if wrong.shape != directions.shape:
            raise ValueError(f"tokens and incorrect_tokens must have the same shape, got "
                             f"{tuple(directions.shape[:-1])} and {tuple(wrong.shape[:-1])}")
        directions = directions - wrong
    while directions.dim() < scaled.dim() - 1:  # ids per sequence: the same at every position
        directions = directions.unsqueeze(-2)
    try:
        attrs = (scaled * directions.to(scaled.dtype)).sum(-1)  # (C, B, L')
    except RuntimeError as exc:
        raise ValueError(f"tokens of shape {tuple(directions.shape[:-1])} do not fit the "
                         f"stack's (batch, positions) {tuple(scaled.shape[1:-1])}") from exc
    if incl_bias:
        bias = logit_bias(cache, tokens, incorrect_tokens).to(attrs)
        while bias.dim() < attrs.dim() - 1:
            bias = bias.unsqueeze(-1)
        attrs = torch.cat([attrs, bias.expand(attrs.shape[1:])[None]])
        if labels is not None:
            labels = [*labels, "bias"]
    return attrs if labels is None else (attrs, labels)
