"""Lenses: read every layer's residual stream in the model's own output space.

* :func:`logit_lens` (causal language models, nostalgebraist 2020): each layer's residual
  ``blocks.{i}.hook_resid_post`` through the final norm and the unembedding, as if the model
  stopped there; the top-k next tokens per position and layer.
* :func:`similarity_lens` (encoders): each layer's hidden states pooled into a sentence
  embedding (the way :func:`handformer.pretrained.embed` pools), and per layer its cosine to
  the final embedding and to a second sentence's embedding at the same layer: at what depth
  the sentence becomes what it will be, and at what depth two sentences part or meet.

Both read the residuals with :func:`~handformer.inspect.run.run_with_cache`.

Shape letters: ``N`` layers, ``B`` batch, ``L`` length, ``E`` hidden size, ``V`` vocabulary,
``K`` top-k.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from handformer.inspect.rollout import select_layers
from handformer.inspect.run import run_with_cache

__all__ = ["LogitLens", "logit_lens", "lens_logits", "SimilarityLens", "similarity_lens"]


@dataclass(frozen=True)
class LogitLens:
    """Top-k next-token predictions of every chosen layer.

    Attributes:
        layers: the layer indices (rows of the tensors).
        top_ids: ``(N', B, L, K)`` token ids, most likely first.
        top_probs: ``(N', B, L, K)`` their softmax probabilities.
    """

    layers: list[int]
    top_ids: Tensor
    top_probs: Tensor


def _unembed(model: nn.Module) -> tuple[nn.Module | None, nn.Module]:
    """The final norm (or None) and the unembedding of a causal LM."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Module) or not hasattr(model, "blocks"):
        raise TypeError(f"logit_lens needs a causal language model (CausalLM, GPT-2) with a "
                        f"final norm and an lm_head, got {type(model).__name__}; for encoders "
                        f"use similarity_lens")
    return getattr(model, "ln_final", None), head


def lens_logits(model: nn.Module, input_ids: Tensor, *, layers: Sequence[int] | None = None,
                attention_mask: Tensor | None = None) -> Tensor:
    """Every chosen layer's residual through the final norm and the unembedding.

    Args:
        model: a :class:`~handformer.CausalLM` (GPT-2 loads into one).
        input_ids: ``(B, L)`` token ids.
        layers: increasing layer indices (default all).
        attention_mask: ``(B, L)`` 1 = real token, as for the model.

    Returns:
        ``(N', B, L, V)`` logits; the last layer's equal the model's own logits.

    Raises:
        TypeError: for a model without an ``lm_head``.
        ValueError: for a layer out of range (the message gives the valid range).
    """
    norm, head = _unembed(model)
    resid = _residuals(model, input_ids, select_layers(layers, len(model.blocks)),
                       attention_mask)
    with torch.inference_mode():
        return head(resid if norm is None else norm(resid))  # (N', B, L, V)


def _residuals(model: nn.Module, input_ids: Tensor, chosen: list[int],
               attention_mask: Tensor | None) -> Tensor:
    """``(N', B, L, E)``: ``blocks.{i}.hook_resid_post`` of the chosen layers, one forward."""
    names = [f"blocks.{i}.hook_resid_post" for i in chosen]
    with torch.inference_mode():
        _, cache = run_with_cache(model, input_ids, attention_mask=attention_mask, names=names)
    return torch.stack([cache[n] for n in names])


def logit_lens(model: nn.Module, input_ids: Tensor, *, k: int = 5,
               layers: Sequence[int] | None = None,
               attention_mask: Tensor | None = None) -> LogitLens:
    """The logit lens: top-``k`` next tokens per layer and position.

    Args:
        model: a :class:`~handformer.CausalLM` (GPT-2 loads into one).
        input_ids: ``(B, L)`` token ids.
        k: how many tokens to keep per position (default 5).
        layers: increasing layer indices (default all).
        attention_mask: ``(B, L)`` 1 = real token.

    Returns:
        A :class:`LogitLens`; memory holds one layer's ``(B, L, V)`` logits at a time.

    Raises:
        ValueError: for ``k`` outside ``1..V`` or a layer out of range.
        TypeError: for a model without an ``lm_head``.
    """
    norm, head = _unembed(model)
    V = head.out_features
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= V:
        raise ValueError(f"k must be an integer in 1..{V} (the vocabulary), got {k!r}")
    chosen = select_layers(layers, len(model.blocks))
    resid = _residuals(model, input_ids, chosen, attention_mask)  # (N', B, L, E)
    ids, probs = [], []
    with torch.inference_mode():
        for layer_resid in resid:  # one layer's (B, L, V) logits at a time
            logits = head(layer_resid if norm is None else norm(layer_resid))
            top = logits.float().softmax(dim=-1).topk(k, dim=-1)
            ids.append(top.indices)
            probs.append(top.values)
    return LogitLens(chosen, torch.stack(ids), torch.stack(probs))


@dataclass(frozen=True)
class SimilarityLens:
    """Per layer, a sentence embedding and how close it is to where it ends up.

    Index 0 is the embedding layer's output (before layer 0), index ``i + 1`` the output of
    layer ``i``; ``labels`` names them.

    Attributes:
        labels: ``["embeddings", "layer 0", ..., "layer N-1"]``.
        embeddings: ``(N + 1, E)`` the text's pooled embedding at each depth; the last row
            equals :func:`handformer.pretrained.embed` of the text.
        to_final: ``(N + 1,)`` cosine of each row to the final embedding (the last is 1).
        to_other: ``(N + 1,)`` cosine to the second text's embedding at the same depth (the
            last is the two texts' embedding similarity), or None without a second text.
    """

    labels: list[str]
    embeddings: Tensor
    to_final: Tensor
    to_other: Tensor | None


def _pooled_layers(model: nn.Module, tokenizer: object, text: str) -> Tensor:
    """``(N + 1, E)`` pooled hidden states of one text at every depth."""
    from handformer.pretrained.pooling import SentencePooling

    pooling = getattr(model, "sentence_pooling", None) or SentencePooling()
    limit = tokenizer.max_length
    if pooling.max_seq_length is not None:
        limit = min(limit, pooling.max_seq_length)
    batch = tokenizer([text], max_length=limit)
    device = next(model.parameters()).device
    batch = {name: v.to(device) for name, v in batch.items()}
    N = len(model.blocks)
    names = ["blocks.0.hook_resid_pre"] + [f"blocks.{i}.hook_resid_post" for i in range(N)]
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            _, cache = run_with_cache(model, **batch, names=names)
            return torch.cat([pooling(cache[n], batch["attention_mask"]) for n in names])
    finally:
        model.train(was_training)


def similarity_lens(model: nn.Module, tokenizer: object, text: str,
                    other: str | None = None) -> SimilarityLens:
    """The similarity lens of a sentence-embedding model.

    Args:
        model: a :class:`~handformer.pretrained.BertModel` (e.g. ``load_bert()``'s).
        tokenizer: its tokenizer.
        text: the sentence to follow through the layers.
        other: an optional second sentence to compare with at every depth.

    Returns:
        A :class:`SimilarityLens`.

    Raises:
        TypeError: for a model that is not a BERT-family encoder.
        ValueError, TypeError: for empty or non-string texts (the tokenizer's errors).
    """
    if not hasattr(model, "embeddings") or not hasattr(model, "blocks"):
        raise TypeError(f"similarity_lens needs a BERT-family encoder (BertModel), got "
                        f"{type(model).__name__}; for causal language models use logit_lens")
    mine = _pooled_layers(model, tokenizer, text).double().cpu()  # (N + 1, E)
    to_final = F.cosine_similarity(mine, mine[-1:].expand_as(mine), dim=-1)
    to_other = None
    if other is not None:
        theirs = _pooled_layers(model, tokenizer, other).double().cpu()
        to_other = F.cosine_similarity(mine, theirs, dim=-1)
    labels = ["embeddings"] + [f"layer {i}" for i in range(mine.shape[0] - 1)]
    return SimilarityLens(labels, mine.float(), to_final, to_other)
