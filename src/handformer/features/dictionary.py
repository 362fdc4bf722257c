"""Dictionaries: sparse autoencoders and transcoders, written out as a few lines of maths.

A *dictionary* turns an activation ``x`` (a residual-stream vector, an MLP's input) into
``d_sae`` feature activations, most of them zero, and back:

    x̃     = x · s                                  (s: the input scaling, 1 by default)
    pre   = (x̃ − b_dec·[apply_b_dec_to_input]) @ W_enc + b_enc        (encode, before the
    acts  = act(pre)                                                   activation)
    x̂     = (acts @ W_dec + b_dec) / s  [+ x @ W_skip]                 (decode)

A *feature* ``f`` is one column ``W_enc[:, f]`` (what it reads) and one row ``W_dec[f]``
(what it writes); ``acts[..., f]`` says how much of it is present. The activations:

- ``relu``: ``act(pre) = max(pre, 0)``.
- ``jumprelu``: ``act(pre) = pre · [pre > threshold]`` (applied to ``max(pre, 0)``, as Gemma
  Scope and SAELens do; it differs only for a negative threshold). A pre-activation exactly at
  the threshold is off.
- ``topk``: keep the ``k`` largest pre-activations of each vector, ReLU them, zero the rest.
  Ties: where several pre-activations equal the k-th largest, the lower feature indices are
  kept, so the result never depends on how ``torch.topk`` orders equal values.

In memory every dictionary has one set of names and orientations, whatever file it came from:
``W_enc (d_in, d_sae)``, ``b_enc (d_sae,)``, ``W_dec (d_sae, d_out)``, ``b_dec (d_out,)``,
``threshold (d_sae,)`` (JumpReLU only), ``W_skip (d_in, d_out)`` (transcoders with a skip term).

:class:`SparseAutoencoder` reconstructs its input (``d_out = d_in``); :class:`Transcoder`
predicts another activation (an MLP's output from its input), so its ``b_dec`` lives in the
output space and is never subtracted from the input.

Hook points (SAELens' names; attached to a model they appear under the hook they replace,
``blocks.6.hook_resid_post.hook_sae_acts_post``, see :mod:`handformer.features.attach`):
``hook_sae_input`` ``(..., d_in)``, ``hook_sae_acts_pre`` and ``hook_sae_acts_post``
``(..., d_sae)``, ``hook_sae_recons`` ``(..., d_out)``, ``hook_sae_error`` ``(..., d_out)``
(spliced with the error term only), ``hook_sae_output`` ``(..., d_out)``.

Shape letters: ``...`` any leading dims (batch, position), ``D`` d_in, ``F`` d_sae,
``O`` d_out.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from handformer.checks import OptionError, check_positive_int
from handformer.hooks import HookPoint

__all__ = ["Dictionary", "SparseAutoencoder", "Transcoder", "ACTIVATIONS", "NORMALIZATIONS",
           "topk_activation", "jumprelu_activation"]

ACTIVATIONS = ("relu", "topk", "jumprelu")
# How the input is scaled before encoding (SAELens' normalize_activations):
# "none": s = 1; "constant_norm_rescale": s = sqrt(d_in) / ||x|| per vector (and the
# reconstruction divided by it again). SAELens' "expected_average_only_in" and "layer_norm"
# are refused by name where a file declares them (see handformer.features.formats).
NORMALIZATIONS = ("none", "constant_norm_rescale")
_FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
HOOKS = ("hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post", "hook_sae_recons",
         "hook_sae_error", "hook_sae_output")


def topk_activation(pre: Tensor, k: int) -> Tensor:
    """``max(pre, 0)`` at the ``k`` largest entries of the last dim, 0 elsewhere.

    Ties at the k-th largest value: the lower indices are kept (deterministic).

    Args:
        pre: ``(..., F)`` pre-activations.
        k: how many to keep, ``1 <= k <= F``.

    Returns:
        ``(..., F)``.
    """
    kth = pre.topk(k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)  # (..., 1)
    above = pre > kth  # (..., F) kept for sure: fewer than k of them
    tied = pre == kth  # (..., F) the k-th value, maybe several times
    room = k - above.sum(dim=-1, keepdim=True)  # (..., 1) how many ties fit
    keep = above | (tied & (tied.cumsum(dim=-1) <= room))  # the lowest-index ties first
    return pre.clamp(min=0) * keep


def jumprelu_activation(pre: Tensor, threshold: Tensor) -> Tensor:
    """``max(pre, 0) · [pre > threshold]`` (a pre-activation at the threshold is off).

    Args:
        pre: ``(..., F)``.
        threshold: ``(F,)``.
    """
    return pre.clamp(min=0) * (pre > threshold)


def _check_dtype(dtype: object) -> torch.dtype:
    if dtype not in _FLOAT_DTYPES:
        raise OptionError("dtype", f"must be one of {[str(d) for d in _FLOAT_DTYPES]}, got "
                                   f"{dtype!r}")
    return dtype  # type: ignore[return-value]


class Dictionary(nn.Module):
    """What :class:`SparseAutoencoder` and :class:`Transcoder` share (see the module's maths).

    Attributes:
        d_in, d_sae, d_out: the sizes.
        activation: ``"relu"``, ``"topk"`` or ``"jumprelu"``; ``k`` for TopK (else None).
        apply_b_dec_to_input: subtract ``b_dec`` from the input before encoding.
        normalize_activations: ``"none"`` or ``"constant_norm_rescale"``.
        input_scale: a constant factor on the input (1.0: none); the reconstruction is divided
            by it (SAELens folds its dataset-norm scaling into this).
        hook_name: the hook the dictionary was trained on (its input), or None.
        meta: where it came from (format, file, the source's config), for display only.
    """

    has_skip: bool = False

    def __init__(self, d_in: int, d_sae: int, d_out: int, *, activation: str, k: int | None,
                 apply_b_dec_to_input: bool, normalize_activations: str,
                 input_scale: float, dtype: torch.dtype, hook_name: str | None,
                 skip: bool) -> None:
        super().__init__()
        self.d_in = check_positive_int("d_in", d_in)
        self.d_sae = check_positive_int("d_sae", d_sae)
        self.d_out = check_positive_int("d_out", d_out)
        if activation not in ACTIVATIONS:
            raise OptionError("activation", f"must be one of {list(ACTIVATIONS)}, got "
                                            f"{activation!r}")
        if activation == "topk":
            k = check_positive_int("k", k)
            if k > d_sae:
                raise OptionError("k", f"must be at most d_sae = {d_sae}, got {k}")
        elif k is not None:
            raise OptionError("k", f"is for activation='topk' only, got k={k!r} with "
                                   f"activation={activation!r}")
        if not isinstance(apply_b_dec_to_input, bool):
            raise OptionError("apply_b_dec_to_input", f"must be True or False, got "
                                                      f"{apply_b_dec_to_input!r}")
        if normalize_activations not in NORMALIZATIONS:
            raise OptionError("normalize_activations", f"must be one of "
                              f"{list(NORMALIZATIONS)}, got {normalize_activations!r}")
        if (isinstance(input_scale, bool) or not isinstance(input_scale, (int, float))
                or not math.isfinite(input_scale) or input_scale <= 0):
            raise OptionError("input_scale", f"must be a positive finite number, got "
                                             f"{input_scale!r}")
        if hook_name is not None and not isinstance(hook_name, str):
            raise OptionError("hook_name", f"must be a string or None, got {hook_name!r}")
        if not isinstance(skip, bool):
            raise OptionError("skip", f"must be True or False, got {skip!r}")
        dtype = _check_dtype(dtype)
        self.activation, self.k = activation, k
        self.apply_b_dec_to_input = apply_b_dec_to_input
        self.normalize_activations = normalize_activations
        self.input_scale = float(input_scale)
        self.hook_name = hook_name
        self.meta: dict[str, Any] = {}

        self.W_enc = nn.Parameter(torch.empty(d_in, d_sae, dtype=dtype))  # (D, F)
        self.b_enc = nn.Parameter(torch.zeros(d_sae, dtype=dtype))  # (F,)
        self.W_dec = nn.Parameter(torch.empty(d_sae, d_out, dtype=dtype))  # (F, O)
        self.b_dec = nn.Parameter(torch.zeros(d_out, dtype=dtype))  # (O,)
        if activation == "jumprelu":
            self.threshold = nn.Parameter(torch.zeros(d_sae, dtype=dtype))  # (F,)
        else:
            self.register_parameter("threshold", None)
        if skip:
            self.W_skip = nn.Parameter(torch.zeros(d_in, d_out, dtype=dtype))  # (D, O)
        else:
            self.register_parameter("W_skip", None)
        self.has_skip = skip
        self.reset_parameters()
        for name in HOOKS:
            setattr(self, name, HookPoint())

    def reset_parameters(self) -> None:
        """Decoder rows random with unit norm, the encoder their transpose, biases 0 (nothing
        on the meta device, where a loader builds the module before giving it its tensors)."""
        if self.W_enc.is_meta:
            return
        with torch.no_grad():
            W = torch.randn(self.d_sae, self.d_out, dtype=torch.float32)  # (F, O)
            W = W / W.norm(dim=-1, keepdim=True)
            self.W_dec.copy_(W)
            if self.d_in == self.d_out:
                self.W_enc.copy_(W.T)
            else:
                self.W_enc.copy_(torch.randn(self.d_in, self.d_sae) / math.sqrt(self.d_in))
            self.b_enc.zero_()
            self.b_dec.zero_()
            if self.threshold is not None:
                self.threshold.zero_()
            if self.W_skip is not None:
                self.W_skip.zero_()

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weights (inputs are computed in it, outputs cast back)."""
        return self.W_enc.dtype

    def extra_repr(self) -> str:
        k = f", k={self.k}" if self.k is not None else ""
        where = f", hook_name={self.hook_name!r}" if self.hook_name else ""
        return (f"d_in={self.d_in}, d_sae={self.d_sae}, d_out={self.d_out}, "
                f"activation={self.activation!r}{k}, dtype={self.dtype}{where}")

    # -- the maths, one step each ------------------------------------------------------------

    def scale(self, x: Tensor) -> Tensor | None:
        """The input scaling ``s`` of ``x`` ``(..., D)``: ``(..., 1)`` for
        constant_norm_rescale (``input_scale · sqrt(d_in) / ||x||``), a 0-dim tensor for a
        constant ``input_scale``, None when there is none (``s = 1``)."""
        if self.normalize_activations == "constant_norm_rescale":
            norm = x.norm(dim=-1, keepdim=True).clamp(min=torch.finfo(x.dtype).tiny)  # (..., 1)
            return self.input_scale * math.sqrt(self.d_in) / norm
        if self.input_scale != 1.0:
            return torch.tensor(self.input_scale, dtype=x.dtype, device=x.device)
        return None

    def pre_activation(self, x: Tensor, s: Tensor | None = None) -> Tensor:
        """``pre = (x · s − b_dec·[apply_b_dec_to_input]) @ W_enc + b_enc``: ``(..., D)`` ->
        ``(..., F)``, in the dictionary's dtype (``s`` default: :meth:`scale` of ``x``)."""
        x = x.to(self.dtype)
        s = self.scale(x) if s is None else s
        if s is not None:
            x = x * s
        if self.apply_b_dec_to_input:
            x = x - self.b_dec
        return x @ self.W_enc + self.b_enc  # (..., F)

    def activate(self, pre: Tensor) -> Tensor:
        """The activation function on ``(..., F)`` pre-activations (see the module docs)."""
        if self.activation == "relu":
            return pre.clamp(min=0)
        if self.activation == "topk":
            return topk_activation(pre, self.k)
        return jumprelu_activation(pre, self.threshold)

    def encode(self, x: Tensor) -> Tensor:
        """Feature activations ``act((x·s − b_dec·[apply]) @ W_enc + b_enc)``.

        Args:
            x: ``(..., D)``.

        Returns:
            ``(..., F)`` in the dictionary's dtype.

        Raises:
            ValueError: if the last dim of ``x`` is not ``d_in``.
        """
        self._check_input(x)
        return self.activate(self.pre_activation(x))

    def decode(self, acts: Tensor, s: Tensor | None = None) -> Tensor:
        """``(acts @ W_dec + b_dec) / s`` (a transcoder's skip term is not in it: see
        :meth:`skip` and :meth:`forward`).

        Args:
            acts: ``(..., F)`` feature activations.
            s: the input scaling :meth:`scale` returned for the input (default: the constant
                ``input_scale``; constant_norm_rescale needs the input's).

        Returns:
            ``(..., O)`` in the dictionary's dtype.

        Raises:
            ValueError: for acts without ``d_sae`` features, or no ``s`` for a
                constant_norm_rescale dictionary.
        """
        if acts.shape[-1] != self.d_sae:
            raise ValueError(f"acts must have d_sae = {self.d_sae} features in the last dim, "
                             f"got shape {tuple(acts.shape)}")
        out = acts.to(self.dtype) @ self.W_dec + self.b_dec  # (..., O)
        if s is None:
            if self.normalize_activations != "none":
                raise ValueError("decode of a constant_norm_rescale dictionary needs s "
                                 "(self.scale(x) of its input); or call forward(x)")
            return out / self.input_scale if self.input_scale != 1.0 else out
        return out / s

    def skip(self, x: Tensor) -> Tensor | None:
        """A transcoder's skip term ``x @ W_skip`` ``(..., O)`` (None without one)."""
        if self.W_skip is None:
            return None
        return x.to(self.dtype) @ self.W_skip

    def reconstruct(self, x: Tensor, acts: Tensor, s: Tensor | None) -> Tensor:
        """``decode(acts, s) + skip(x)`` in the dictionary's dtype."""
        out = self.decode(acts, s)
        skip = self.skip(x)
        return out if skip is None else out + skip

    def forward(self, x: Tensor) -> Tensor:
        """The reconstruction (a transcoder's prediction) ``x̂``, through the hook points.

        ``x̂ = (act(pre) @ W_dec + b_dec) / s + x @ W_skip·[skip]``.

        Args:
            x: ``(..., D)``.

        Returns:
            ``(..., O)`` in ``x``'s dtype.
        """
        return self.replace(x, None)

    # -- the hooked pass, used by forward and by splicing --------------------------------------

    def replace(self, x: Tensor, target: Tensor | None) -> Tensor:
        """Run through the hook points; with ``target``, add the error term.

        Without ``target``: returns ``hook_sae_output(x̂)``, the reconstruction.
        With ``target`` (what the model computed: ``x`` itself for an SAE, the MLP's output
        for a transcoder): returns ``hook_sae_output(x̂ + error)`` where
        ``error = hook_sae_error(target − x̂_clean)`` and ``x̂_clean`` is the reconstruction
        with no hook changing anything. When no hook changed the input, the activations, the
        reconstruction or the error, ``x̂ + error`` is ``target`` up to float rounding, and
        ``target`` itself is passed on (so a dictionary spliced with its error term leaves the
        model's output exactly as it was); otherwise ``x̂ + error`` is computed, so that
        ablating feature ``f`` moves the output by exactly ``−acts[f] · W_dec[f] / s``.

        Args:
            x: ``(..., D)`` the input.
            target: ``(..., O)`` or None.

        Returns:
            ``(..., O)`` in the dtype of ``target`` (or of ``x``).
        """
        self._check_input(x)
        out_dtype = (target if target is not None else x).dtype
        x_in = self.hook_sae_input(x)
        s = self.scale(x_in.to(self.dtype))
        pre_raw = self.pre_activation(x_in, s)
        pre = self.hook_sae_acts_pre(pre_raw)
        acts_raw = self.activate(pre)
        acts = self.hook_sae_acts_post(acts_raw)
        recons_raw = self.reconstruct(x_in, acts, s).to(out_dtype)
        recons = self.hook_sae_recons(recons_raw)
        if target is None:
            return self.hook_sae_output(recons)
        changed = (x_in is not x or pre is not pre_raw or acts is not acts_raw
                   or recons is not recons_raw)
        clean = self._clean(x) if changed else recons_raw
        error_raw = target - clean
        error = self.hook_sae_error(error_raw)
        if not changed and error is error_raw:
            return self.hook_sae_output(target)  # = recons + error, without its rounding
        return self.hook_sae_output(recons + error)

    def _clean(self, x: Tensor) -> Tensor:
        """The reconstruction of ``x`` with no hook point involved, in ``x``'s dtype."""
        s = self.scale(x.to(self.dtype))
        acts = self.activate(self.pre_activation(x, s))
        return self.reconstruct(x, acts, s).to(x.dtype)

    def _check_input(self, x: Tensor) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.d_in:
            raise ValueError(f"x must have d_in = {self.d_in} in the last dim, got shape "
                             f"{tuple(x.shape)}")

    # -- a plain description, for saving --------------------------------------------------------

    def config(self) -> dict[str, Any]:
        """The constructor's arguments as JSON-able values (what ``save_dictionary`` writes)."""
        cfg: dict[str, Any] = {
            "kind": "transcoder" if isinstance(self, Transcoder) else "sae",
            "d_in": self.d_in, "d_sae": self.d_sae, "d_out": self.d_out,
            "activation": self.activation, "k": self.k,
            "normalize_activations": self.normalize_activations,
            "input_scale": self.input_scale, "dtype": str(self.dtype).removeprefix("torch."),
            "hook_name": self.hook_name,
        }
        if isinstance(self, Transcoder):
            cfg["skip"] = self.has_skip
            cfg["output_hook_name"] = self.output_hook_name
        else:
            cfg["apply_b_dec_to_input"] = self.apply_b_dec_to_input
        return cfg


class SparseAutoencoder(Dictionary):
    """A sparse autoencoder: ``x -> acts -> x̂ ≈ x`` (see the module's maths).

    Args:
        d_in: the activation's size ``D``.
        d_sae: the number of features ``F``.
        activation: ``"relu"``, ``"topk"`` (needs ``k``) or ``"jumprelu"`` (has ``threshold``).
        k: active features per vector for TopK.
        apply_b_dec_to_input: subtract ``b_dec`` before encoding (SAELens' default; Gemma
            Scope's SAEs do not).
        normalize_activations: ``"none"`` or ``"constant_norm_rescale"`` (``x`` scaled to norm
            ``sqrt(d_in)`` per vector before encoding, the reconstruction scaled back).
        input_scale: a constant factor on the input before encoding (the reconstruction is
            divided by it).
        dtype: of the weights (float32, bfloat16, float16, float64).
        hook_name: the hook it reads and reconstructs (``blocks.6.hook_resid_post``).

    Parameters: ``W_enc (D, F)``, ``b_enc (F,)``, ``W_dec (F, D)``, ``b_dec (D,)``,
    ``threshold (F,)`` for JumpReLU.

    Raises:
        ValueError: for a bad option (an :class:`~handformer.checks.OptionError` naming it).
    """

    def __init__(self, d_in: int, d_sae: int, *, activation: str = "relu",
                 k: int | None = None, apply_b_dec_to_input: bool = True,
                 normalize_activations: str = "none", input_scale: float = 1.0,
                 dtype: torch.dtype = torch.float32, hook_name: str | None = None) -> None:
        super().__init__(d_in, d_sae, d_in, activation=activation, k=k,
                         apply_b_dec_to_input=apply_b_dec_to_input,
                         normalize_activations=normalize_activations, input_scale=input_scale,
                         dtype=dtype, hook_name=hook_name, skip=False)


class Transcoder(Dictionary):
    """A transcoder: an MLP's input ``x`` -> ``acts`` -> a prediction of the MLP's output.

    ``ŷ = (act((x·s) @ W_enc + b_enc) @ W_dec + b_dec) / s + x @ W_skip·[skip]``:
    ``b_dec`` lives in the output space, so it is never subtracted from the input.

    Args:
        d_in: the MLP input's size ``D``.
        d_sae: the number of features ``F``.
        d_out: the MLP output's size ``O`` (default ``d_in``).
        activation, k, normalize_activations, input_scale, dtype: as
            :class:`SparseAutoencoder`.
        skip: a linear skip term ``W_skip (D, O)`` (Gemma Scope 2's ``_affine`` transcoders,
            circuit-tracer's skip transcoders).
        apply_b_dec_to_input: must stay False (refused: ``b_dec`` is an output-space bias).
        hook_name: the hook it reads (``blocks.6.ln2.hook_normalized``).
        output_hook_name: the hook it predicts (``blocks.6.hook_mlp_out``).

    Raises:
        ValueError: for a bad option, ``apply_b_dec_to_input=True`` included.
    """

    def __init__(self, d_in: int, d_sae: int, d_out: int | None = None, *,
                 activation: str = "relu", k: int | None = None, skip: bool = False,
                 apply_b_dec_to_input: bool = False, normalize_activations: str = "none",
                 input_scale: float = 1.0, dtype: torch.dtype = torch.float32,
                 hook_name: str | None = None, output_hook_name: str | None = None) -> None:
        if apply_b_dec_to_input is not False:
            raise OptionError("apply_b_dec_to_input", "must be False for a Transcoder: its "
                              "b_dec is a bias of the output space (d_out), never subtracted "
                              f"from the input; got {apply_b_dec_to_input!r}")
        if output_hook_name is not None and not isinstance(output_hook_name, str):
            raise OptionError("output_hook_name", f"must be a string or None, got "
                                                  f"{output_hook_name!r}")
        super().__init__(d_in, d_sae, d_in if d_out is None else d_out, activation=activation,
                         k=k, apply_b_dec_to_input=False,
                         normalize_activations=normalize_activations, input_scale=input_scale,
                         dtype=dtype, hook_name=hook_name, skip=skip)
        self.output_hook_name = output_hook_name
