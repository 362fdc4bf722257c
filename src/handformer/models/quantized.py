"""Int8 inference, opt in: linear layers whose weights are int8, activations still float32.

``load_lm(source, quantize="int8")`` swaps every ``nn.Linear`` of a causal LM (the q/k/v/out
projections, the MLP's, the LM head) for an :class:`Int8Linear` of the same name, as the
loader hands it each weight: a float weight is quantized and freed before the next one is
read, so the whole model never exists in float32. Everything else stays float32: the token
embedding, the norms, the activations, the residual stream, the KV cache. Hook points sit
between the modules, so every hook sees (and may replace) the same float tensors, at the same
names and shapes, as in the float model.

The scheme (the one llama.cpp's Q8_0 and torch's dynamic quantization share): each output row
of ``W`` gets one scale, ``s_r = max|W_r| / 127``, and is stored as ``round(W_r / s_r)``
in int8; each call quantizes its input on the fly (one scale per call, from the input's
range), multiplies in integers and scales back to float32.

The kernel is PyTorch's own (``torch.ops.quantized.linear_dynamic``, FBGEMM with VNNI on
x86). Measured on this project's 2-core host, one thread: a 49,152 x 576 matrix-vector
product (SmolLM2's LM head) 1.2 ms against float32's 10-19 ms; 1,536 x 576 over 512 tokens
3.0 ms against 22.7 ms. torchao 0.18 (the successor PyTorch points to; it installs on torch
2.13 with no dependency, so without another torch) is slower on the CPU for the same
shapes: its int8 weight-only path 58 ms for the LM head product, its dynamic int8 path 92 ms
(9 ms under ``torch.compile``); ``torch._weight_int8pack_mm`` (weight-only) 83 ms. So they are
not used. ``torch.ao``'s quantized tensors are deprecated; if they go, this module is the one
place to change (docs/llms.md, "Quantized inference", has the figures and what int8 changes
for interpretability).

Reading ``Int8Linear.weight`` returns the *dequantized* float32 matrix (``s_r * q_r``), a new
tensor each time: the weights the model actually multiplies by, so direct logit attribution,
``W_U`` / ``W_O`` reads and ``hook_result`` see the quantized model's own weights.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

__all__ = ["Int8Linear", "Int8Installer", "check_quantize", "quantize_model",
           "QUANTIZE_CHOICES"]

QUANTIZE_CHOICES = ("int8",)
# The activations use the full int8 range: the host's VNNI instructions accumulate without
# the overflow that reduce_range (7-bit activations) guards against on older CPUs.
_REDUCE_RANGE = False


@contextmanager
def _quiet() -> Iterator[None]:
    """torch warns that quantized tensors are deprecated each time one is made."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantize.*deprecated.*")
        yield


def check_quantize(quantize: object, dtype: torch.dtype | None = None,
                   device: object = "cpu") -> str | None:
    """Validate a ``quantize`` option; return it (None: no quantization).

    Raises:
        ValueError: for a value other than None or ``"int8"``, a dtype other than float32, or
            a device other than the CPU (the kernel is the CPU's).
    """
    if quantize is None:
        return None
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be None or one of {list(QUANTIZE_CHOICES)}, got "
                         f"{quantize!r}")
    if dtype not in (None, torch.float32):
        raise ValueError(f"quantize={quantize!r} keeps the activations in float32: dtype must "
                         f"be float32 (or None), got {dtype}")
    if torch.device(device).type != "cpu":  # type: ignore[arg-type]
        raise ValueError(f"quantize={quantize!r} runs on the CPU only (FBGEMM's kernel), got "
                         f"device={device!r}")
    return quantize


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` stored in int8, one scale per output row; ``x`` and ``y``
    float32.

    Args:
        weight: the float weight ``(out_features, in_features)``; it is quantized here and
            not kept.
        bias: ``(out_features,)`` float bias, or None. It stays float32 (a parameter named
            ``bias``, as ``nn.Linear``'s).

    Attributes:
        in_features, out_features: as ``nn.Linear``'s.
        activation_dtype: the dtype the layer takes and returns (float32).

    Raises:
        ValueError: for a weight that is not 2-D, or not finite.
    """

    activation_dtype = torch.float32

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"Int8Linear needs a 2-D weight (out, in), got shape "
                             f"{tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self._packed = _pack(weight.detach())
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = bias if isinstance(bias, nn.Parameter) else nn.Parameter(
                bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """The int8 version of ``linear`` (its weight quantized, its bias kept)."""
        return cls(linear.weight, linear.bias)

    @property
    def weight(self) -> Tensor:
        """The dequantized weight ``(out_features, in_features)``, float32: a new tensor each
        time (what the layer multiplies by)."""
        qweight, _ = torch.ops.quantized.linear_unpack(self._packed)
        return qweight.dequantize()

    def forward(self, x: Tensor) -> Tensor:
        """``(..., in_features)`` float32 -> ``(..., out_features)`` float32."""
        if x.dtype != torch.float32:
            raise TypeError(f"Int8Linear takes float32 inputs (its activations stay float32), "
                            f"got {x.dtype}")
        # Two int8 products: the input on its 8-bit grid, then what that grid missed (the
        # rounding error, on a grid 256 times finer). One product alone loses the small
        # entries of an input with outlier channels (an LLM's MLP hidden vector): top-1
        # agreement with float32 fell to 36-69 % on SmolLM2.
        coarse = torch.quantize_per_tensor_dynamic(x, torch.quint8, _REDUCE_RANGE).dequantize()
        y = torch.ops.quantized.linear_dynamic(coarse, self._packed, _REDUCE_RANGE)
        y += torch.ops.quantized.linear_dynamic(x - coarse, self._packed, _REDUCE_RANGE)
        return y if self.bias is None else y + self.bias

    def __deepcopy__(self, memo: dict) -> Int8Linear:
        """A copy that shares the packed int8 weights (nothing writes them: a model's variant,
        e.g. ``handformer serve``'s per-attention copies, costs no second copy); the bias is
        copied as ``copy.deepcopy`` copies parameters (``memo`` may share it)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        nn.Module.__init__(new)
        new.out_features, new.in_features, new.training = (self.out_features,
                                                           self.in_features, self.training)
        new._packed = self._packed
        new.bias = copy.deepcopy(self.bias, memo)
        return new

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int8 per-row weights")


def _pack(weight: Tensor) -> object:
    """FBGEMM's packed int8 form of a float weight ``(out, in)``, one scale per row."""
    if not torch.isfinite(weight).all():
        raise ValueError(f"cannot quantize a weight {tuple(weight.shape)} with inf or NaN "
                         "entries")
    weight = weight.float()
    scales = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()  # (out,)
    zeros = torch.zeros(weight.shape[0], dtype=torch.long)
    with _quiet():
        qweight = torch.quantize_per_channel(weight, scales, zeros, 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(qweight, None)


class Int8Installer:
    """What a loader calls with each float weight of a model built on ``meta``: a linear
    layer's weight becomes an :class:`Int8Linear` in its place at once (the float tensor can
    then be freed); everything else is the loader's to install.

    Args:
        model: the model, its parameters still on ``meta``.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def take(self, name: str, value: Tensor) -> bool:
        """Install ``value`` if ``name`` is a linear layer's weight (True), else False."""
        owner, _, leaf = name.rpartition(".")
        if leaf != "weight":
            return False
        module = self.model.get_submodule(owner)
        if type(module) is not nn.Linear:
            return False
        _replace(self.model, owner, Int8Linear(value, module.bias))  # bias: filled later
        return True

    def tie(self, embedding: Tensor, head: str = "lm_head") -> None:
        """A head tied to the embedding: an int8 copy of it (the embedding stays float)."""
        _replace(self.model, head, Int8Linear(embedding))


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def quantize_model(model: nn.Module) -> nn.Module:
    """Swap every ``nn.Linear`` of ``model`` (in place) for an :class:`Int8Linear`, one at a
    time; the embedding and everything else stay as they are. For a model already in memory
    (``load_lm(..., quantize="int8")`` quantizes while it reads the checkpoint instead).

    Returns:
        ``model``.
    """
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    for name in names:
        _replace(model, name, Int8Linear.from_linear(model.get_submodule(name)))
    return model
