"""Convert between ``torch.nn`` modules and handformer modules, weights included.

``from_torch(module)`` builds the handformer module with the same weights; ``to_torch(module)``
goes back. handformer modules are batch-first: a converted ``batch_first=False`` torch module
expects ``(B, L, E)`` inputs afterwards (transpose ``(L, B, E)`` inputs with ``x.transpose(0,
1)``). Masks change convention too: convert torch masks with
:func:`handformer.masks.from_torch_mask`.

Two modules, imports in one direction: :mod:`~handformer.interop.encoder` holds the conversion
tables (dicts from type to converter), ``from_torch`` / ``to_torch`` and the attention and
encoder-layer converters; :mod:`~handformer.interop.decoder` imports it and registers the
decoder layer, decoder and encoder-decoder ``Transformer`` beside them.
"""

from handformer.interop import decoder as _decoder  # noqa: F401  (registers the decoder side)
from handformer.interop.encoder import FROM_TORCH, TO_TORCH, from_torch, to_torch

__all__ = ["from_torch", "to_torch", "FROM_TORCH", "TO_TORCH"]
