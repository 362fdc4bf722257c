"""How good a dictionary is, as SAE papers and SAEBench report it: :func:`evaluate_dictionary`.

Every number is taken over every position but the first of each window: position 0 is the
attention sink, whose activation's norm is many times the others' and would dominate the
sums; it is left as the model computed it when the dictionary is spliced in. With ``y`` the
activation (an SAE's input, a transcoder's MLP output), ``ŷ`` the dictionary's reconstruction
(prediction), ``z`` its feature activations, over ``N`` evaluation tokens:

* explained variance ``1 − Σ‖y − ŷ‖² / Σ‖y − ȳ‖²`` (``ȳ`` the mean over the tokens);
* L0: the mean number of active features per token, ``mean Σ_f [z_f > 0]``;
* dead fraction: features never active on the evaluation tokens; dense fraction: features
  active on more than ``dense_threshold`` (10 %) of them;
* CE loss recovered ``(CE_zero − CE_spliced) / (CE_zero − CE_clean)`` (SAELens' definition):
  ``CE_clean`` the model's next-token loss, ``CE_spliced`` with ``ŷ`` in place of ``y``
  (no error term), ``CE_zero`` with ``y`` zeroed; beside it the mean-ablation baseline
  ``(CE_mean − CE_spliced) / (CE_mean − CE_clean)``, ``y`` replaced by its mean over the
  evaluation tokens (harder to beat: the mean keeps what every token shares);
* KL divergence ``KL(p_clean ‖ p_spliced)`` of the next-token distributions, mean per token.

The losses are over the predictions made at positions ``1 .. L-2`` (those whose activation
was replaced and that have a next token). Sums are accumulated in float64.

Shape letters: ``B`` windows, ``L`` length, ``E`` activation dim, ``S`` features, ``V``
vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from handformer.features.dictionary import Dictionary, Transcoder
from handformer.features.stream import ActivationReader, Site, TokenWindows, windows_for

__all__ = ["DictionaryMetrics", "evaluate_dictionary", "explained_variance", "l0",
           "ce_loss_recovered", "DENSE_THRESHOLD"]

DENSE_THRESHOLD = 0.1


def explained_variance(y: Tensor, y_hat: Tensor) -> float:
    """``1 − Σ‖y − ŷ‖² / Σ‖y − ȳ‖²`` over the rows of ``(N, E)`` tensors (float64)."""
    y, y_hat = y.double(), y_hat.double()
    return 1.0 - float((y - y_hat).pow(2).sum() / (y - y.mean(0)).pow(2).sum())


def l0(z: Tensor) -> float:
    """Mean number of non-zero features per row of ``(N, S)`` activations."""
    return float((z != 0).double().sum(-1).mean())


def ce_loss_recovered(ce_clean: float, ce_spliced: float, ce_ablated: float) -> float:
    """``(CE_ablated − CE_spliced) / (CE_ablated − CE_clean)`` (nan if the ablation costs
    nothing)."""
    gap = ce_ablated - ce_clean
    return (ce_ablated - ce_spliced) / gap if gap != 0 else math.nan


@dataclass
class DictionaryMetrics:
    """The metrics of one dictionary at one site (see the module docstring).

    Attributes:
        at: the hook.
        tokens: evaluation tokens (positions 1.. of every window).
        explained_variance, l0: as the module docstring defines them.
        dead_fraction, dense_fraction: features never active; active on more than
            ``dense_threshold`` of the tokens.
        dense_threshold: the fraction of tokens above which a feature counts as dense.
        ce_clean, ce_spliced, ce_zero, ce_mean: next-token losses (nats per token).
        ce_loss_recovered: against zero ablation.
        ce_loss_recovered_mean: against mean ablation.
        kl: ``KL(p_clean ‖ p_spliced)`` per token.
        density: ``(S,)`` the fraction of evaluation tokens each feature is active on.
    """

    at: str
    tokens: int
    explained_variance: float
    l0: float
    dead_fraction: float
    dense_fraction: float
    ce_clean: float
    ce_spliced: float
    ce_zero: float
    ce_mean: float
    ce_loss_recovered: float
    ce_loss_recovered_mean: float
    kl: float
    dense_threshold: float = DENSE_THRESHOLD
    density: Tensor = field(default_factory=lambda: torch.zeros(0), repr=False)

    def to_dict(self) -> dict:
        """The numbers as a JSON-ready dict (``density`` left out)."""
        d = asdict(self)
        d.pop("density")
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in d.items()}


def _site_of(model: nn.Module, dictionary: Dictionary, at: str) -> Site:
    if isinstance(dictionary, Transcoder):
        import re

        m = re.match(r"^blocks\.(\d+)\.hook_mlp_out$", at)
        if not m:
            raise ValueError(f"a transcoder is evaluated at blocks.N.hook_mlp_out (the MLP "
                             f"output it predicts), got at={at!r}")
        return Site(at, True, int(m.group(1)))
    return Site(at, False, None)


def _replace(at: str, new: Tensor | None, fn: object = None) -> dict:
    """A hook spec replacing positions 1.. at ``at`` by ``fn(value)`` or by ``new``
    (broadcast); position 0, the sink, keeps the model's value."""
    def hook(t: Tensor, name: str) -> Tensor:
        value = fn(t) if fn is not None else new.to(t.dtype).expand_as(t)  # (B, L, E)
        out = t.clone()
        out[:, 1:] = value[:, 1:].to(t.dtype)
        return out
    return {at: hook}


def _ce(logits: Tensor, ids: Tensor) -> Tensor:
    """Per-prediction losses at positions 1..L-2 (predicting tokens 2..), ``(B*(L-2),)``
    float64 (the log-softmax in float32, a window at a time: a 262k vocabulary is large)."""
    out = []
    for b in range(logits.shape[0]):
        logp = F.log_softmax(logits[b, 1:-1].float(), dim=-1)  # (L-2, V)
        target = ids[b, 2:].to(logp.device)  # (L-2,)
        out.append(-logp.gather(-1, target[:, None])[:, 0].double())
    return torch.cat(out)


def _kl_sum(clean: Tensor, other: Tensor) -> float:
    """``Σ KL(p_clean ‖ p_other)`` over the predictions at positions 1..L-2, float64, a window
    at a time."""
    total = 0.0
    for b in range(clean.shape[0]):
        p = F.log_softmax(clean[b, 1:-1].double(), dim=-1)  # (L-2, V)
        q = F.log_softmax(other[b, 1:-1].double(), dim=-1)
        total += float((p.exp() * (p - q)).sum())
    return total


@torch.no_grad()
def evaluate_dictionary(model: nn.Module, dictionary: Dictionary, corpus: object, *, at: str,
                        tokens: int = 20_000, context: int = 128, batch: int = 8,
                        tokenizer: object = None, seed: int = 1,
                        dense_threshold: float = DENSE_THRESHOLD) -> DictionaryMetrics:
    """Evaluate ``dictionary`` at hook ``at`` of ``model`` (see the module docstring).

    Args:
        model: a handformer causal LM.
        dictionary: an SAE reading ``at``, or a transcoder predicting ``at``
            (``blocks.N.hook_mlp_out``) from that block's MLP input.
        corpus: a corpus (name, file, list of texts; needs ``tokenizer``), a ``(T,)`` id
            tensor, a ``(B, L)`` tensor of windows, or :class:`TokenWindows`.
        at: the hook.
        tokens: evaluation tokens (rounded up to whole batches of windows).
        context, batch: window length and windows per forward pass.
        tokenizer: the model's tokenizer (for a text corpus).
        seed: which windows (a different seed than training's keeps them apart).
        dense_threshold: a feature active on more than this fraction of tokens is dense.

    Returns:
        A :class:`DictionaryMetrics`.

    Raises:
        ValueError: for a dictionary whose ``d_in`` is not the activation's size, a
            transcoder at another hook, too little data. KeyError: for an unknown hook.
    """
    from handformer.inspect.run import hooks

    model.eval()
    site = _site_of(model, dictionary, at)
    if isinstance(corpus, Tensor) and corpus.dim() == 2:
        batches = [corpus[i:i + batch] for i in range(0, corpus.shape[0], batch)]
    else:
        windows = corpus if isinstance(corpus, TokenWindows) else windows_for(
            model, corpus, tokenizer, context=context, seed=seed)
        per = batch * (windows.length - 1)
        batches = [windows.batch(i, batch) for i in range(-(-tokens // per))]
    reader = ActivationReader(model, [site])
    device = next(model.parameters()).device

    # pass 1: the activation's mean over the evaluation tokens (the mean-ablation value)
    total, count = None, 0
    for ids in batches:
        _, y = reader.read(ids.to(device))[at]
        total = y.double().sum(0) if total is None else total + y.double().sum(0)
        count += y.shape[0]
    mean = (total / count).float()

    S = dictionary.d_sae
    fired = torch.zeros(S, dtype=torch.float64)
    sums = dict.fromkeys(("err", "y", "y2", "l0", "clean", "spliced", "zero", "mean", "kl"),
                         0.0)
    y_sum = torch.zeros_like(mean, dtype=torch.float64)
    n_rows = n_pred = 0
    for ids in batches:
        ids = ids.to(device)
        acts, clean = reader.read_and_run(ids)  # clean: (B, L, V), the same forward
        x, y = acts[at]
        z = dictionary.encode(x).float()  # (N, S)
        y_hat = dictionary(x).float()  # (N, E)
        sums["err"] += float((y - y_hat).double().pow(2).sum())
        sums["y2"] += float(y.double().pow(2).sum())
        y_sum += y.double().sum(0)
        sums["l0"] += float((z != 0).double().sum())
        fired += (z != 0).double().sum(0)
        n_rows += y.shape[0]

        spliced = _spliced_logits(model, dictionary, site, ids, hooks)
        ce_clean = _ce(clean, ids)
        sums["clean"] += float(ce_clean.sum())
        sums["spliced"] += float(_ce(spliced, ids).sum())
        sums["kl"] += _kl_sum(clean, spliced)
        del clean, spliced
        zero = _with(model, hooks, _replace(at, torch.zeros(())), ids)
        sums["zero"] += float(_ce(zero, ids).sum())
        del zero
        sums["mean"] += float(_ce(_with(model, hooks, _replace(at, mean), ids), ids).sum())
        n_pred += ce_clean.numel()
    if n_rows < 2 or n_pred < 1:
        raise ValueError(f"evaluation needs at least 2 tokens past the first of each window, "
                         f"got {n_rows}")
    # Σ‖y − ȳ‖² = Σ‖y‖² − N ‖ȳ‖²
    total_var = sums["y2"] - float(y_sum.pow(2).sum()) / n_rows
    density = (fired / n_rows).float()
    ce = {key: sums[key] / n_pred for key in ("clean", "spliced", "zero", "mean")}
    return DictionaryMetrics(
        at=at, tokens=n_rows, explained_variance=1.0 - sums["err"] / total_var,
        l0=sums["l0"] / n_rows, dead_fraction=float((fired == 0).double().mean()),
        dense_fraction=float((density > dense_threshold).double().mean()),
        ce_clean=ce["clean"], ce_spliced=ce["spliced"], ce_zero=ce["zero"], ce_mean=ce["mean"],
        ce_loss_recovered=ce_loss_recovered(ce["clean"], ce["spliced"], ce["zero"]),
        ce_loss_recovered_mean=ce_loss_recovered(ce["clean"], ce["spliced"], ce["mean"]),
        kl=sums["kl"] / n_pred, dense_threshold=dense_threshold, density=density)


def _with(model: nn.Module, hooks: object, spec: dict, ids: Tensor) -> Tensor:
    with hooks(model, spec):
        return model(ids).logits


def _spliced_logits(model: nn.Module, dictionary: Dictionary, site: Site, ids: Tensor,
                    hooks: object) -> Tensor:
    """The logits with positions 1.. of ``site.at`` replaced by the dictionary's output."""
    if not site.transcoder:
        return _with(model, hooks, _replace(site.at, None, lambda t: dictionary(t)), ids)
    seen: dict[str, Tensor] = {}

    def pre(module: nn.Module, args: tuple) -> None:
        seen["x"] = args[0]

    handle = model.blocks[site.layer].mlp.register_forward_pre_hook(pre)
    try:
        return _with(model, hooks, _replace(site.at, None, lambda t: dictionary(seen["x"])), ids)
    finally:
        handle.remove()
