"""Build a model with its parameters on the ``meta`` device: no memory, no initialisation.

The loaders (:func:`handformer.pretrained.load_lm` and the tensor-parallel one) build the
model of a checkpoint's config inside :func:`parameters_on_meta`, then fill each parameter
from the file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import Tensor, nn

__all__ = ["parameters_on_meta"]


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside put their parameters on the ``meta`` device (no memory, no
    initialisation cost); buffers and plain tensors (RoPE frequencies) stay real.

    The ``torch.nn.init`` functions leave meta tensors alone inside: the first random fill
    of a meta tensor imports torch's Python meta kernels (about 800 modules, sympy and mpmath
    among them), 74 MB of resident memory for nothing (measured with torch 2.13)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    def skip_meta(fill: Callable) -> Callable:
        def init(tensor: Tensor, *args: object, **kwargs: object) -> Tensor:
            return tensor if tensor.is_meta else fill(tensor, *args, **kwargs)
        return init

    fills = {name: getattr(nn.init, name) for name in _INIT_FILLS}
    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    for name, fill in fills.items():
        setattr(nn.init, name, skip_meta(fill))
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]
        for name, fill in fills.items():
            setattr(nn.init, name, fill)


# the torch.nn.init functions that modules' constructors call to fill a parameter
_INIT_FILLS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_",
               "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_")
