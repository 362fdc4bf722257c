"""What a dictionary is trained to do: the parameters, the losses, and the decoder's unit norm.

The recipe is Gao et al. 2024, "Scaling and evaluating sparse autoencoders" (OpenAI), with its
laptop-sized defaults:

* **Units.** The inputs are scaled by one number per site, ``s = sqrt(E) / mean ||x||``
  (measured on the first batch), so that every site trains with the same learning rate; the
  scale is folded back into the weights when the dictionary is saved
  (:meth:`TrainingDictionary.folded`), so the saved dictionary reads raw activations.
* **Encode.** ``pre = (x - b_dec) W_enc + b_enc`` (a transcoder does not subtract ``b_dec``:
  its ``b_dec`` lives in the output space); ``z = TopK(pre)`` keeps the ``k`` largest
  pre-activations, through a ReLU, and zeroes the rest (``"relu"``: ``z = ReLU(pre)``, with
  an L1 penalty instead).
* **Decode.** ``x_hat = z W_dec + b_dec``; a skip transcoder adds a linear term,
  ``y_hat = z W_dec + b_dec + x W_skip`` (Paulo et al. 2025, "Transcoders beat sparse
  autoencoders for interpretability": the dense linear part of an MLP's map goes through
  ``W_skip`` and the latents are left the rest).
* **Loss.** The normalised reconstruction error ``sum ||y - y_hat||^2 / (N var(y))``, ``var``
  the total variance per row measured on the first batch (a constant: a mean over rows, so
  data-parallel ranks average to the same gradient), plus ``aux_coeff`` (1/32) times AuxK:
  the ``k_aux`` largest pre-activations among the *dead* latents (not fired over the last
  ``dead_after`` training tokens) reconstruct the error ``e = y - y_hat``, normalised by
  ``||e||^2``: gradient reaches latents that TopK would never pick again.
* **Decoder rows at unit norm.** Before each step the gradient's component along each row of
  ``W_dec`` is removed; after it every row is divided by its norm.
* **Initialisation.** ``W_dec`` random unit rows, ``W_enc = W_dec^T`` (where the shapes
  agree), ``b_enc = 0``, ``b_dec`` the geometric median of the first batch's inputs (an SAE)
  or the mean of its targets (a transcoder); ``W_skip = 0`` (a least-squares start from the
  first batch, ~1,000 rows for 576 dims, over-fits it and generalises worse than zero).

Shape letters: ``N`` rows (tokens), ``E`` input dim, ``F`` output dim, ``S`` latents.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["TrainingDictionary", "DictionarySet", "geometric_median", "paper_lr",
           "project_decoder_grad", "normalise_decoder", "KINDS"]

KINDS = ("topk", "relu")
SET_TYPE = "handformer-dictionary-training"


def paper_lr(d_sae: int) -> float:
    """Gao et al.'s learning rate for ``d_sae`` latents: ``2e-4 / sqrt(d_sae / 2^14)``."""
    return 2e-4 / math.sqrt(d_sae / 2**14)


def geometric_median(x: Tensor, *, iterations: int = 50, eps: float = 1e-6) -> Tensor:
    """The point minimising the sum of Euclidean distances to the rows of ``x`` ``(N, E)``
    (Weiszfeld's iteration, from the mean), float64 inside."""
    x = x.double()
    m = x.mean(0)  # (E,)
    for _ in range(iterations):
        w = 1.0 / (x - m).norm(dim=-1).clamp_min(eps)  # (N,)
        new = (w[:, None] * x).sum(0) / w.sum()
        if (new - m).norm() <= eps * max(float(m.norm()), 1.0):
            m = new
            break
        m = new
    return m.float()


class TrainingDictionary(nn.Module):
    """One site's dictionary while it trains, in scaled units (see the module docstring).

    Args:
        d_in: input dim ``E``.
        d_sae: latents ``S``.
        d_out: output dim ``F`` (``E`` for an SAE).
        kind: ``"topk"`` or ``"relu"``.
        k: active latents per row (TopK).
        transcoder: a transcoder (no ``b_dec`` subtracted from the input).
        generator: the random generator of the initial weights.
        skip: a linear skip term ``W_skip (E, F)`` (transcoders only).

    Raises:
        ValueError: for an unknown kind, ``k`` outside ``[1, d_sae]`` for TopK, a skip term
            on an SAE.
    """

    def __init__(self, d_in: int, d_sae: int, d_out: int, *, kind: str, k: int | None,
                 transcoder: bool, generator: torch.Generator, skip: bool = False) -> None:
        super().__init__()
        if skip and not transcoder:
            raise ValueError("skip=True is a transcoder's option (an SAE reconstructs its "
                             "own input: a linear skip would learn the identity)")
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {list(KINDS)} to train (a JumpReLU "
                             f"dictionary is loaded, not trained here), got {kind!r}")
        if kind == "topk" and (not isinstance(k, int) or isinstance(k, bool)
                               or not 1 <= k <= d_sae):
            raise ValueError(f"k must be an int in [1, d_sae={d_sae}] for TopK, got {k!r}")
        self.kind, self.k, self.transcoder = kind, k, transcoder
        W_dec = torch.randn(d_sae, d_out, generator=generator)  # (S, F)
        W_dec = W_dec / W_dec.norm(dim=-1, keepdim=True)
        if d_in == d_out:
            W_enc = W_dec.T.clone()  # (E, S)
        else:
            W_enc = torch.randn(d_in, d_sae, generator=generator) / math.sqrt(d_in)
        self.W_enc = nn.Parameter(W_enc)
        self.b_enc = nn.Parameter(torch.zeros(d_sae))
        self.W_dec = nn.Parameter(W_dec)
        self.b_dec = nn.Parameter(torch.zeros(d_out))
        self.W_skip = nn.Parameter(torch.zeros(d_in, d_out)) if skip else None  # (E, F)
        # scale_in, scale_out, variance: set from the first batch; since_fired: training
        # tokens since each latent was last active (dead-latent bookkeeping)
        self.register_buffer("scale_in", torch.ones(()))
        self.register_buffer("scale_out", torch.ones(()))
        self.register_buffer("variance", torch.ones(()))
        self.register_buffer("since_fired", torch.zeros(d_sae, dtype=torch.int64))

    @torch.no_grad()
    def initialise(self, x: Tensor, y: Tensor) -> None:
        """Scales, target variance and ``b_dec`` from the first batch (raw units)."""
        self.scale_in.fill_(math.sqrt(x.shape[-1]) / float(x.norm(dim=-1).mean()))
        self.scale_out.fill_(math.sqrt(y.shape[-1]) / float(y.norm(dim=-1).mean()))
        y = y * self.scale_out
        self.variance.fill_(float((y - y.mean(0)).pow(2).sum(-1).mean()))
        if self.transcoder:
            self.b_dec.copy_(y.mean(0))
        else:
            self.b_dec.copy_(geometric_median(x * self.scale_in))

    def pre_acts(self, x: Tensor) -> Tensor:
        """``(x - b_dec) W_enc + b_enc`` (no ``- b_dec`` for a transcoder), ``(N, S)``."""
        if not self.transcoder:
            x = x - self.b_dec
        return x @ self.W_enc + self.b_enc

    def activate(self, pre: Tensor) -> Tensor:
        """TopK (the ``k`` largest, through a ReLU; the rest 0) or ReLU, ``(N, S)``."""
        if self.kind == "relu":
            return F.relu(pre)
        values, index = pre.topk(self.k, dim=-1)  # (N, k)
        return torch.zeros_like(pre).scatter(-1, index, F.relu(values))

    def decode(self, z: Tensor) -> Tensor:
        """``z W_dec + b_dec``, ``(N, F)`` (the skip term is not in it: see :meth:`skip`)."""
        return z @ self.W_dec + self.b_dec

    def skip(self, x: Tensor) -> Tensor | int:
        """The skip term ``x W_skip`` ``(N, F)`` (scaled units), 0 without one."""
        return 0 if self.W_skip is None else x @ self.W_skip

    def losses(self, x: Tensor, y: Tensor, *, dead_after: int, k_aux: int, aux_coeff: float,
               l1_coeff: float) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of one batch (raw units in) and its parts.

        Returns:
            ``(loss, parts)``: parts ``mse`` (normalised), ``aux``, ``l1``, ``l0`` (mean active
            latents per row), ``dead`` (latents counted dead), ``fired`` ``(S,)`` bool (pass
            it to :meth:`count_firing`), all detached but ``loss``.
        """
        x, y = x * self.scale_in, y * self.scale_out
        if self.kind == "topk":
            pre, index, acts, y_hat = self._topk_forward(x)
            fired = torch.zeros(pre.shape[-1], dtype=torch.bool)
            fired[index[acts > 0]] = True  # (S,)
            l0 = (acts > 0).float().sum(-1).mean()
        else:
            pre = self.pre_acts(x)  # (N, S)
            z = self.activate(pre)  # (N, S)
            y_hat = self.decode(z) + self.skip(x)  # (N, F)
            fired, l0 = (z > 0).any(0), (z > 0).float().sum(-1).mean()
        err = y - y_hat
        mse = err.pow(2).sum(-1).mean() / self.variance
        loss = mse
        dead = self.since_fired >= dead_after  # (S,): as of the steps before this one
        aux = torch.zeros(())
        if aux_coeff > 0 and self.kind == "topk" and bool(dead.any()):
            k = min(k_aux, int(dead.sum()))
            values, index = pre.masked_fill(~dead, float("-inf")).topk(k, dim=-1)  # (N, k)
            recons = F.embedding_bag(index, self.W_dec, per_sample_weights=F.relu(values),
                                     mode="sum")  # (N, F): sum_j relu(values_j) W_dec[index_j]
            e = err.detach()
            aux = (e - recons).pow(2).sum() / e.pow(2).sum().clamp_min(1e-12)
            loss = loss + aux_coeff * aux
        l1 = torch.zeros(())
        if self.kind == "relu":
            l1 = z.sum(-1).mean() / math.sqrt(x.shape[-1])
            loss = loss + l1_coeff * l1
        parts = {"mse": mse.detach(), "aux": aux.detach(), "l1": l1.detach(),
                 "l0": l0.detach(), "dead": dead.float().sum(), "fired": fired}
        return loss, parts

    def _topk_forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """TopK's encode and a decoder that sums only the ``k`` chosen rows of ``W_dec``.

        ``embedding_bag`` adds ``acts[n, j] * W_dec[index[n, j]]`` over ``j``: ``N k F``
        multiply-adds instead of the dense ``(N, S) @ (S, F)`` product and the two of its
        backward pass (the same sum: every other latent's activation is zero).

        Returns:
            ``(pre, index, acts, y_hat)``: ``pre`` ``(N, S)``, the chosen ``index`` ``(N, k)``,
            their activations ``acts`` ``(N, k)`` and ``y_hat`` ``(N, F)``.
        """
        pre = self.pre_acts(x)  # (N, S)
        values, index = pre.topk(self.k, dim=-1)  # (N, k)
        acts = F.relu(values)
        y_hat = F.embedding_bag(index, self.W_dec, per_sample_weights=acts, mode="sum")
        return pre, index, acts, y_hat + self.b_dec + self.skip(x)  # y_hat: (N, F)

    @torch.no_grad()
    def count_firing(self, fired: Tensor, rows: int) -> None:
        """Add ``rows`` training tokens to every latent's count; reset those that ``fired``."""
        self.since_fired.add_(rows).masked_fill_(fired, 0)

    @torch.no_grad()
    def folded(self) -> dict[str, Tensor]:
        """The weights for raw activations: the scales folded in (see the module docstring).

        With ``z_raw = z / s_in``: ``W_enc`` unchanged, ``b_enc / s_in``, ``b_dec / s_in`` (an
        SAE) or ``b_dec / s_out`` (a transcoder), ``W_dec * s_in / s_out`` (an SAE: unchanged,
        rows of unit norm), ``W_skip * s_in / s_out`` (``x_raw s_in W_skip / s_out``).
        """
        s_in, s_out = float(self.scale_in), float(self.scale_out)
        b_dec = self.b_dec / (s_out if self.transcoder else s_in)
        out = {"W_enc": self.W_enc.detach().clone(), "b_enc": self.b_enc / s_in,
               "W_dec": self.W_dec * (s_in / s_out), "b_dec": b_dec.clone()}
        if self.W_skip is not None:
            out["W_skip"] = self.W_skip * (s_in / s_out)
        return out


@torch.no_grad()
def project_decoder_grad(W_dec: nn.Parameter) -> None:
    """Remove from ``W_dec.grad`` each row's component along that row (rows unit norm)."""
    if W_dec.grad is not None:
        W_dec.grad -= (W_dec.grad * W_dec).sum(-1, keepdim=True) * W_dec


@torch.no_grad()
def normalise_decoder(W_dec: nn.Parameter) -> None:
    """Divide every row of ``W_dec`` by its norm."""
    W_dec.div_(W_dec.norm(dim=-1, keepdim=True).clamp_min(1e-12))


def site_key(at: str) -> str:
    """A module name for a hook name (dots are not allowed in ``nn.ModuleDict`` keys)."""
    return at.replace(".", "__")


class DictionarySet(nn.Module):
    """Every site's :class:`TrainingDictionary` of one run, as one module the trainer's
    checkpoints save (``save_pretrained``: ``model.safetensors`` + ``config.json``).

    Args:
        config: the run's dictionary options (JSON-ready; written as ``config.json``).
        dims: ``{at: (d_in, d_out)}`` per site, in order.
        generator: the initial weights' random generator.
    """

    def __init__(self, config: dict, dims: dict[str, tuple[int, int]],
                 generator: torch.Generator) -> None:
        super().__init__()
        self.config = {"model_type": SET_TYPE, **config,
                       "sites": {at: list(d) for at, d in dims.items()}}
        self.dicts = nn.ModuleDict({
            site_key(at): TrainingDictionary(d_in, config["d_sae"], d_out, kind=config["kind"],
                                             k=config["k"], transcoder=config["transcoder"],
                                             generator=generator,
                                             skip=bool(config.get("skip", False)))
            for at, (d_in, d_out) in dims.items()})

    def items(self) -> list[tuple[str, TrainingDictionary]]:
        """``(hook name, dictionary)`` per site."""
        return [(at, self.dicts[site_key(at)]) for at in self.config["sites"]]

    def save_pretrained(self, folder: str | Path) -> None:
        """Write ``model.safetensors`` and ``config.json`` into ``folder`` (atomically each)."""
        from handformer.train.checkpoint import atomic_write_bytes
        from handformer.weights import save_safetensors

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_safetensors({k: v.contiguous() for k, v in self.state_dict().items()},
                         folder / "model.safetensors")
        atomic_write_bytes(folder / "config.json",
                           (json.dumps(self.config, indent=1) + "\n").encode())
