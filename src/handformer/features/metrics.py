"""How good a dictionary is, as SAE papers and SAEBench report it: :func:`evaluate_dictionary`.

Every number is taken over every position but the first of each window: position 0 is the
attention sink, whose activation's norm is many times the others' and would dominate the
sums; it is left as the model computed it when the dictionary is spliced in. With ``y`` the
activation (an SAE's input, a transcoder's MLP output), ``ŷ`` the dictionary's reconstruction
(prediction), ``z`` its feature activations, over ``N`` evaluation tokens:

* explained variance ``1 − Σ‖y − ŷ‖² / Σ‖y − ȳ‖²`` (``ȳ`` the mean over the tokens); beside
  it the same over the *typical* tokens, those whose input and target norms are at most
  ``MASSIVE`` (10) times their batch's median: a few delimiter tokens carry massive
  activations (second attention sinks, ~100x the median norm; one row in ~1,000 in some
  SmolLM2 layers), and one of them, squared, can outweigh the other rows of the sum;
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
import re
from dataclasses import asdict, dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from handformer.features.dictionary import Dictionary, Transcoder
from handformer.features.stream import (
    ActivationReader,
    Site,
    TokenWindows,
    typical_mask,
    windows_for,
)

__all__ = ["DictionaryMetrics", "evaluate_dictionary", "evaluate_dictionaries",
           "explained_variance", "l0", "ce_loss_recovered", "DENSE_THRESHOLD"]

DENSE_THRESHOLD = 0.1
MASSIVE = 10.0


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
        explained_variance_typical: over the rows without massive activations.
        massive_fraction: the fraction of rows with massive activations (left out of
            ``explained_variance_typical``).
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
    explained_variance_typical: float = math.nan
    massive_fraction: float = 0.0
    dense_threshold: float = DENSE_THRESHOLD
    density: Tensor = field(default_factory=lambda: torch.zeros(0), repr=False)

    def to_dict(self) -> dict:
        """The numbers as a JSON-ready dict (``density`` left out)."""
        d = asdict(self)
        d.pop("density")
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in d.items()}


def _site_of(model: nn.Module, dictionary: Dictionary, at: str) -> Site:
    block = re.match(r"^blocks\.(\d+)\.", at)
    if isinstance(dictionary, Transcoder):
        if not re.match(r"^blocks\.(\d+)\.hook_mlp_out$", at):
            raise ValueError(f"a transcoder is evaluated at blocks.N.hook_mlp_out (the MLP "
                             f"output it predicts), got at={at!r}")
        return Site(at, True, int(block.group(1)))
    return Site(at, False, int(block.group(1)) if block else None)


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
    return evaluate_dictionaries(model, {at: dictionary}, corpus, tokens=tokens,
                                 context=context, batch=batch, tokenizer=tokenizer, seed=seed,
                                 dense_threshold=dense_threshold)[at]


@torch.no_grad()
def evaluate_dictionaries(model: nn.Module, dictionaries: dict[str, Dictionary],
                          corpus: object, *, tokens: int = 20_000, context: int = 128,
                          batch: int = 8, tokenizer: object = None, seed: int = 1,
                          dense_threshold: float = DENSE_THRESHOLD
                          ) -> dict[str, DictionaryMetrics]:
    """:func:`evaluate_dictionary` for several dictionaries at once (every layer's
    transcoders, say), on the same windows, sharing the forward passes.

    Per batch of windows: one pass to the deepest site for the activations' means, one
    clean forward pass for every site's activations, the clean logits and each site's block
    input; then, per site, the three spliced runs (the dictionary's output, zero, the mean)
    start at the site's block (:meth:`~handformer.CausalLM.run_from`) instead of the
    embeddings: the blocks before it are what the clean pass computed. Each site's numbers
    are those :func:`evaluate_dictionary` defines, alone.

    Args:
        model: a handformer causal LM.
        dictionaries: ``{hook: dictionary}`` (see :func:`evaluate_dictionary`'s ``at``).
        corpus, tokens, context, batch, tokenizer, seed, dense_threshold: as
            :func:`evaluate_dictionary`'s.

    Returns:
        ``{hook: DictionaryMetrics}``, in the order given.

    Raises:
        ValueError / KeyError: as :func:`evaluate_dictionary`.
    """
    from handformer.inspect.run import hooks

    model.eval()
    sites = {at: _site_of(model, d, at) for at, d in dictionaries.items()}
    if isinstance(corpus, Tensor) and corpus.dim() == 2:
        batches = [corpus[i:i + batch] for i in range(0, corpus.shape[0], batch)]
    else:
        windows = corpus if isinstance(corpus, TokenWindows) else windows_for(
            model, corpus, tokenizer, context=context, seed=seed)
        per = batch * (windows.length - 1)
        batches = [windows.batch(i, batch) for i in range(-(-tokens // per))]
    reader = ActivationReader(model, list(sites.values()))
    device = next(model.parameters()).device

    # pass 1: each activation's mean over the evaluation tokens (the mean-ablation value)
    totals: dict[str, Tensor] = {}
    count = 0
    for ids in batches:
        read = reader.read(ids.to(device))
        for at, (_, y) in read.items():
            totals[at] = y.double().sum(0) + totals.get(at, 0.0)
        count += next(iter(read.values()))[1].shape[0]  # the same rows at every site
    means = {at: (t / count).float() for at, t in totals.items()}

    acc = {at: _Sums(d.d_sae, means[at]) for at, d in dictionaries.items()}
    starts = {at: _start_block(s) for at, s in sites.items()}
    for ids in batches:
        ids = ids.to(device)
        B, L = ids.shape
        positions = torch.arange(L, device=device).expand(B, L)  # (B, L)
        inputs: dict[int, Tensor] = {}  # block -> its input (B, L, E) in the clean pass
        with hooks(model, {f"blocks.{i}.hook_resid_pre": partial(_keep_input, inputs)
                           for i in set(starts.values()) if i < len(model.blocks)}):
            acts, clean = reader.read_and_run(ids)  # clean: (B, L, V), the same forward
        ce_clean = _ce(clean, ids)
        for at, d in dictionaries.items():
            a, site = acc[at], sites[at]
            x, y = acts[at]
            a.add_reconstruction(d, x, y)
            rest = partial(_run_rest, model, ids, positions, inputs, starts[at])
            spliced = _spliced_logits(model, d, site, rest)
            a.sums["clean"] += float(ce_clean.sum())
            a.sums["spliced"] += float(_ce(spliced, ids).sum())
            a.sums["kl"] += _kl_sum(clean, spliced)
            del spliced
            a.sums["zero"] += float(_ce(rest(_replace(at, torch.zeros(()))), ids).sum())
            a.sums["mean"] += float(_ce(rest(_replace(at, means[at])), ids).sum())
            a.n_pred += ce_clean.numel()
        del clean
    return {at: acc[at].metrics(at, dense_threshold) for at in dictionaries}


def _keep_input(store: dict[int, Tensor], t: Tensor, name: str) -> None:
    """Hook: keep ``blocks.{i}.hook_resid_pre``'s value under ``i``."""
    store[int(name.split(".")[1])] = t


def _run_rest(model: nn.Module, ids: Tensor, positions: Tensor, inputs: dict[int, Tensor],
              start: int, spec: dict) -> Tensor:
    """The logits of ``ids`` with the hook spec ``spec``, from block ``start``'s kept input
    (the whole forward pass when there is none)."""
    from handformer.inspect.run import hooks

    with hooks(model, spec):
        if start == 0 or start not in inputs:
            return model(ids).logits
        return model.run_from(inputs[start], positions, start=start)


def _start_block(site: Site) -> int:
    """The block whose input the spliced runs start from: the site's own (0 for a site
    outside the blocks, such as the embeddings: the whole forward pass)."""
    return site.layer if site.layer is not None else 0


class _Sums:
    """One site's running sums (float64) over the evaluation batches."""

    def __init__(self, d_sae: int, mean: Tensor) -> None:
        self.fired = torch.zeros(d_sae, dtype=torch.float64)
        self.sums = dict.fromkeys(("err", "y2", "l0", "clean", "spliced", "zero", "mean",
                                   "kl", "err_t", "y2_t"), 0.0)
        self.y_sum = torch.zeros_like(mean, dtype=torch.float64)
        self.y_sum_t = torch.zeros_like(mean, dtype=torch.float64)
        self.n_rows = self.n_pred = self.n_typical = 0

    def add_reconstruction(self, dictionary: Dictionary, x: Tensor, y: Tensor) -> None:
        z = dictionary.encode(x).float()  # (N, S)
        y_hat = dictionary(x).float()  # (N, E)
        err2 = (y - y_hat).double().pow(2).sum(-1)  # (N,)
        self.sums["err"] += float(err2.sum())
        self.sums["y2"] += float(y.double().pow(2).sum())
        self.y_sum += y.double().sum(0)
        keep = typical_mask(x, y, MASSIVE)  # (N,)
        self.sums["err_t"] += float(err2[keep].sum())
        self.sums["y2_t"] += float(y[keep].double().pow(2).sum())
        self.y_sum_t += y[keep].double().sum(0)
        self.n_typical += int(keep.sum())
        self.sums["l0"] += float((z != 0).double().sum())
        self.fired += (z != 0).double().sum(0)
        self.n_rows += y.shape[0]

    def metrics(self, at: str, dense_threshold: float) -> DictionaryMetrics:
        s, n_rows, n_pred = self.sums, self.n_rows, self.n_pred
        if n_rows < 2 or n_pred < 1:
            raise ValueError(f"evaluation needs at least 2 tokens past the first of each "
                             f"window, got {n_rows}")
        # Σ‖y − ȳ‖² = Σ‖y‖² − N ‖ȳ‖²
        total_var = s["y2"] - float(self.y_sum.pow(2).sum()) / n_rows
        typical_var = s["y2_t"] - float(self.y_sum_t.pow(2).sum()) / max(self.n_typical, 1)
        density = (self.fired / n_rows).float()
        ce = {key: s[key] / n_pred for key in ("clean", "spliced", "zero", "mean")}
        return DictionaryMetrics(
            at=at, tokens=n_rows, explained_variance=1.0 - s["err"] / total_var,
            l0=s["l0"] / n_rows, dead_fraction=float((self.fired == 0).double().mean()),
            dense_fraction=float((density > dense_threshold).double().mean()),
            ce_clean=ce["clean"], ce_spliced=ce["spliced"], ce_zero=ce["zero"],
            ce_mean=ce["mean"],
            ce_loss_recovered=ce_loss_recovered(ce["clean"], ce["spliced"], ce["zero"]),
            ce_loss_recovered_mean=ce_loss_recovered(ce["clean"], ce["spliced"], ce["mean"]),
            kl=s["kl"] / n_pred, dense_threshold=dense_threshold, density=density,
            explained_variance_typical=(1.0 - s["err_t"] / typical_var if typical_var > 0
                                        else math.nan),
            massive_fraction=1.0 - self.n_typical / n_rows)


def _spliced_logits(model: nn.Module, dictionary: Dictionary, site: Site, rest: object
                    ) -> Tensor:
    """The logits with positions 1.. of ``site.at`` replaced by the dictionary's output
    (``rest(spec)`` runs the model with the hook spec ``spec``)."""
    if not site.transcoder:
        return rest(_replace(site.at, None, lambda t: dictionary(t)))
    seen: dict[str, Tensor] = {}

    def pre(module: nn.Module, args: tuple) -> None:
        seen["x"] = args[0]

    handle = model.blocks[site.layer].mlp.register_forward_pre_hook(pre)
    try:
        return rest(_replace(site.at, None, lambda t: dictionary(seen["x"])))
    finally:
        handle.remove()
