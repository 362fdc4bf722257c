"""Using features: what a feature writes to the logits, where it fires, steering, ablation.

* :func:`feature_logit_effects`: ``W_dec[f]`` read through the final norm's weight and the
  unembedding, as direct logit attribution reads a component
  (:func:`~handformer.inspect.attribution.tokens_to_residual_directions`): the tokens a feature
  promotes and suppresses (for a feature written into the residual stream; the logit before a
  soft-cap; a LayerNorm model's direction is centred first, as LayerNorm does).
* :func:`feature_cards`: in one pass over a corpus, each feature's density (fraction of tokens
  it is active on), a histogram of its non-zero activations, and its top-activating contexts
  with the activating token marked ``⟦like this⟧``.
* :func:`steer`: add ``coefficient · W_dec[f]`` at the dictionary's hook, every position, for a
  ``with`` block (around ``generate`` too: the hook is active in this thread only).
* :func:`feature_ablation_sweep` / :func:`feature_patching_sweep`: the change of a metric when
  each feature is zeroed (or patched from a clean run into a corrupted one), the dictionary
  spliced with its error term, through the inspect sweeps' batched machinery.

Shape letters: ``B`` windows, ``L`` length, ``N`` rows, ``E`` model dim, ``S`` features,
``V`` vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from handformer.features.dictionary import Dictionary, Transcoder
from handformer.features.stream import ActivationReader, Site, TokenWindows, windows_for
from handformer.inspect.attribution import tokens_to_residual_directions

__all__ = ["FeatureLogits", "feature_logit_effects", "Context", "FeatureCard", "feature_cards",
           "steer", "feature_ablation_sweep", "feature_patching_sweep", "writes_at"]

MARK = ("⟦", "⟧")


def writes_at(dictionary: Dictionary, at: str | None = None) -> str:
    """The hook a dictionary writes to: ``at``, else its ``output_hook_name`` (a
    transcoder) or ``hook_name``.

    Raises:
        ValueError: when neither is known.
    """
    if at is not None:
        return at
    name = (dictionary.output_hook_name if isinstance(dictionary, Transcoder)
            else dictionary.hook_name)
    if name is None:
        raise ValueError("at is needed: the dictionary does not say which hook it was "
                         "trained on (hook_name / output_hook_name is None)")
    return name


def _check_feature(dictionary: Dictionary, feature: int) -> int:
    if isinstance(feature, bool) or not isinstance(feature, int) or not (
            0 <= feature < dictionary.d_sae):
        raise ValueError(f"feature must be an int in [0, {dictionary.d_sae}), got {feature!r}")
    return feature


@dataclass
class FeatureLogits:
    """The tokens a feature's decoder row promotes (``top``) and suppresses (``bottom``).

    Attributes:
        feature: the feature.
        top_ids, top_values: ``(k,)`` the largest logit effects, largest first.
        bottom_ids, bottom_values: ``(k,)`` the most negative, most negative first.
        top_tokens, bottom_tokens: the tokens as text (when a tokenizer was given).
    """

    feature: int
    top_ids: Tensor
    top_values: Tensor
    bottom_ids: Tensor
    bottom_values: Tensor
    top_tokens: list[str] = field(default_factory=list)
    bottom_tokens: list[str] = field(default_factory=list)


@torch.no_grad()
def feature_logit_effects(model: nn.Module, dictionary: Dictionary, feature: int, *,
                          k: int = 10, tokenizer: object = None,
                          chunk: int = 16384) -> FeatureLogits:
    """``W_dec[f] · (w_norm ⊙ W_U[t])`` for every token ``t``; the ``k`` largest and smallest.

    Args:
        model: the causal LM the dictionary writes into (its ``lm_head`` and final norm).
        dictionary: an SAE or transcoder of that model (``d_out`` = the model width).
        feature: the feature index.
        k: how many tokens each way.
        tokenizer: to add the tokens as text.
        chunk: vocabulary rows per matrix product (bounds the memory).

    Raises:
        ValueError: for a feature out of range or a dictionary of another width.
    """
    f = _check_feature(dictionary, feature)
    V, E = model.lm_head.weight.shape
    if dictionary.d_out != E:
        raise ValueError(f"the dictionary writes d_out = {dictionary.d_out}, the model's "
                         f"residual stream has width {E}")
    direction = dictionary.W_dec[f].float()  # (E,)
    if isinstance(getattr(model, "ln_final", None), nn.LayerNorm):
        direction = direction - direction.mean()  # LayerNorm centres what it reads
    effects = torch.cat([tokens_to_residual_directions(model, torch.arange(i, min(i + chunk, V)))
                         .float() @ direction for i in range(0, V, chunk)])  # (V,)
    k = min(k, V)
    top, bottom = effects.topk(k), (-effects).topk(k)
    out = FeatureLogits(f, top.indices, top.values, bottom.indices, -bottom.values)
    if tokenizer is not None:
        out.top_tokens = [tokenizer.decode([int(t)]) for t in top.indices]
        out.bottom_tokens = [tokenizer.decode([int(t)]) for t in bottom.indices]
    return out


@dataclass
class Context:
    """One top-activating context: the activation, and the text around the token.

    Attributes:
        activation: the feature's activation at the token.
        before, token, after: the text before the token, the token, the text after.
        ids: the window's token ids; position: the token's position in it.
    """

    activation: float
    before: str
    token: str
    after: str
    ids: list[int]
    position: int

    def marked(self) -> str:
        """``before⟦token⟧after``."""
        return f"{self.before}{MARK[0]}{self.token}{MARK[1]}{self.after}"


@dataclass
class FeatureCard:
    """What :func:`feature_cards` found about one feature.

    Attributes:
        feature: the index; tokens: evaluation tokens seen (positions 1.. of each window).
        density: the fraction of tokens it is active on.
        histogram: counts of its non-zero activations in ``bins`` equal bins between 0 and
            ``edges[-1]`` (the largest activation seen); ``edges`` ``(bins + 1,)``.
        contexts: the top-activating contexts, largest first.
    """

    feature: int
    tokens: int
    density: float
    histogram: Tensor
    edges: Tensor
    contexts: list[Context]


@torch.no_grad()
def feature_cards(model: nn.Module, dictionary: Dictionary, corpus: object,
                  features: Sequence[int], *, at: str | None = None, tokens: int = 20_000,
                  context: int = 64, batch: int = 8, k: int = 8, around: int = 12,
                  bins: int = 20, tokenizer: object = None, seed: int = 2) -> list[FeatureCard]:
    """Density, activation histogram and top-activating contexts of ``features``.

    Args:
        model, dictionary: the model and a dictionary of it.
        corpus: a corpus (with ``tokenizer``), a ``(T,)`` id tensor or :class:`TokenWindows`.
        features: the feature indices.
        at: the hook (default the dictionary's own; a transcoder: its output hook).
        tokens, context, batch: how much text, window length, windows per forward pass.
        k: contexts per feature.
        around: tokens shown each side of the activating token.
        bins: histogram bins.
        tokenizer: for the context text (without one: the ids).
        seed: which windows.

    Returns:
        One :class:`FeatureCard` per feature, in the order given.

    Raises:
        ValueError: for a feature out of range.
    """
    feats = torch.tensor([_check_feature(dictionary, f) for f in features], dtype=torch.long)
    where = writes_at(dictionary, at)
    site = (Site(where, True, int(where.split(".")[1])) if isinstance(dictionary, Transcoder)
            else Site(where))
    reader = ActivationReader(model, [site])
    windows = corpus if isinstance(corpus, TokenWindows) else windows_for(
        model, corpus, tokenizer, context=context, seed=seed)
    F_ = len(feats)
    best = torch.full((k, F_), -1.0)  # (k, F) activations of the kept contexts
    where_ids = torch.zeros(k, F_, windows.length, dtype=torch.int32)  # their windows
    where_pos = torch.zeros(k, F_, dtype=torch.long)
    fired = torch.zeros(F_, dtype=torch.float64)
    values: list[Tensor] = []
    n = 0
    per = batch * (windows.length - 1)
    for step in range(-(-tokens // per)):
        ids = windows.batch(step, batch)  # (B, L)
        x, _ = reader.read(ids.to(next(model.parameters()).device))[where]
        z = dictionary.encode(x).float()[:, feats]  # (N, F)
        fired += (z > 0).double().sum(0)
        values.append(z)  # for the histograms
        n += z.shape[0]
        top = z.topk(min(k, z.shape[0]), dim=0)  # (k', F)
        rows = top.indices  # (k', F) row = window * (L-1) + position - 1
        merged = torch.cat([best, top.values])  # (k + k', F)
        cand_ids = torch.cat([where_ids, ids[rows // (windows.length - 1)].to(torch.int32)])
        cand_pos = torch.cat([where_pos, rows % (windows.length - 1) + 1])
        keep = merged.topk(k, dim=0).indices  # (k, F)
        best = merged.gather(0, keep)
        where_ids = cand_ids[keep, torch.arange(F_)]
        where_pos = cand_pos.gather(0, keep)
    cards = []
    for j, f in enumerate(feats.tolist()):
        acts = torch.cat([v[:, j][v[:, j] > 0] for v in values])
        top_value = float(acts.max()) if acts.numel() else 1.0
        edges = torch.linspace(0, top_value, bins + 1)
        hist = torch.histc(acts, bins=bins, min=0, max=top_value) if acts.numel() \
            else torch.zeros(bins)
        contexts = [_context(where_ids[i, j].tolist(), int(where_pos[i, j]), float(best[i, j]),
                             around, tokenizer)
                    for i in range(k) if best[i, j] > 0]
        cards.append(FeatureCard(f, n, float(fired[j]) / n, hist, edges, contexts))
    return cards


def _context(ids: list[int], pos: int, value: float, around: int, tokenizer: object) -> Context:
    def text(part: list[int]) -> str:
        if tokenizer is None:
            return " ".join(str(i) for i in part)
        return tokenizer.decode(part)
    lo = max(pos - around, 1)  # position 0 is the BOS / sink
    before, token, after = ids[lo:pos], ids[pos:pos + 1], ids[pos + 1:pos + 1 + around]
    sep = " " if tokenizer is None else ""
    return Context(value, text(before) + sep * bool(before), text(token),
                   sep * bool(after) + text(after), ids, pos)


@contextlib.contextmanager
def steer(model: nn.Module, dictionary: Dictionary, feature: int, coefficient: float, *,
          at: str | None = None) -> Iterator[None]:
    """Add ``coefficient · W_dec[feature]`` to the activation at ``at``, every position, for
    the ``with`` block (this thread only; ``generate`` inside it is steered).

    Args:
        model: the model.
        dictionary: the dictionary whose feature to add.
        feature: the feature index.
        coefficient: how much of it (negative: subtract).
        at: the hook (default: where the dictionary writes: its ``hook_name``, a transcoder's
            ``output_hook_name``).

    Raises:
        ValueError: for a feature out of range, a non-finite coefficient, a hook of another
            width. KeyError: for an unknown hook.
    """
    from handformer.inspect.run import hooks

    f = _check_feature(dictionary, feature)
    if isinstance(coefficient, bool) or not isinstance(coefficient, (int, float)) or not (
            float(coefficient) == float(coefficient) and abs(coefficient) != float("inf")):
        raise ValueError(f"coefficient must be a finite number, got {coefficient!r}")
    where = writes_at(dictionary, at)
    direction = (float(coefficient) * dictionary.W_dec[f]).detach()  # (E,)

    def add(t: Tensor, name: str) -> Tensor:
        if t.shape[-1] != direction.shape[-1]:
            raise ValueError(f"feature {f} writes {direction.shape[-1]} dims, {name} has "
                             f"{t.shape[-1]}")
        return t + direction.to(device=t.device, dtype=t.dtype)

    with hooks(model, {where: add}):
        yield


def _acts_point(dictionary: Dictionary, at: str | None) -> str:
    return f"{writes_at(dictionary, at)}.hook_sae_acts_post"


def feature_ablation_sweep(model: nn.Module, dictionary: Dictionary, inputs: object,
                           metric: object, *, features: Sequence[int], at: str | None = None,
                           batch_size: int = 16) -> Tensor:
    """``metric(features[i] zeroed) − metric(clean)`` for each feature, the dictionary spliced
    with its error term (so a zeroed feature removes exactly ``acts[f] · W_dec[f]``).

    Args:
        model, dictionary: the model and the dictionary to splice (at ``at`` or its own hook).
        inputs: the model's inputs ``(B, L)`` (or a tokenizer's output).
        metric: ``metric(output) -> number`` (e.g. a logit difference).
        features: the features to ablate, one at a time.
        at: where (default the dictionary's own hook).
        batch_size: ablations per forward pass.

    Returns:
        ``(len(features),)`` float64.
    """
    from handformer.features.attach import attach
    from handformer.inspect.ablation import _call, _metric_value, _sweep

    feats = [_check_feature(dictionary, f) for f in features]
    point = _acts_point(dictionary, at)

    def zero(rows: Tensor, f: int) -> Tensor:
        rows = rows.clone()
        rows[..., f] = 0
        return rows

    with attach(model, dictionary, at=_attach_at(dictionary, at)):
        with torch.no_grad():
            clean = _metric_value(metric, _call(model, (inputs,), {}))
        values = _sweep(model, inputs, metric, [(point, lambda r, f=f: zero(r, f))
                                                for f in feats],
                        batch_size=batch_size, progress=False, desc="ablating features")
    return torch.tensor(values, dtype=torch.float64) - clean


def feature_patching_sweep(model: nn.Module, dictionary: Dictionary, clean: object,
                           corrupted: object, metric: object, *, features: Sequence[int],
                           at: str | None = None, batch_size: int = 16) -> Tensor:
    """``metric(corrupted run with feature f's activations from the clean run) −
    metric(corrupted)`` for each feature (every position), the dictionary spliced with its
    error term.

    Args:
        model, dictionary: the model and the dictionary to splice (at ``at`` or its own hook).
        clean, corrupted: the two runs' inputs ``(B, L)``, of one shape.
        metric: ``metric(output) -> number`` (e.g. a logit difference).
        features: the features to patch, one at a time.
        at: where (default the dictionary's own hook).
        batch_size: patched runs per forward pass.

    Returns:
        ``(len(features),)`` float64.
    """
    from handformer.features.attach import attach
    from handformer.inspect.ablation import _call, _metric_value, _sweep, check_pair
    from handformer.inspect.run import run_with_cache

    check_pair(clean, corrupted)
    feats = [_check_feature(dictionary, f) for f in features]
    point = _acts_point(dictionary, at)
    with attach(model, dictionary, at=_attach_at(dictionary, at)):
        with torch.no_grad():
            _, cache = run_with_cache(model, clean, names=point)
            base = _metric_value(metric, _call(model, (corrupted,), {}))
        source = cache[point]  # (B, L, S)

        def patch(rows: Tensor, f: int) -> Tensor:
            rows = rows.clone()
            rows[..., f] = source[..., f].to(rows.dtype)
            return rows

        values = _sweep(model, corrupted, metric, [(point, lambda r, f=f: patch(r, f))
                                                   for f in feats],
                        batch_size=batch_size, progress=False, desc="patching features")
    return torch.tensor(values, dtype=torch.float64) - base


def _attach_at(dictionary: Dictionary, at: str | None) -> object:
    """What :func:`~handformer.features.attach` takes for ``at``."""
    if isinstance(dictionary, Transcoder):
        if at is None:
            return None
        return f"blocks.{int(at.split('.')[1])}.mlp"
    return at
