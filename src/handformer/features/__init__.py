"""Features: sparse autoencoders and transcoders, loaded from what people publish, spliced
into a model.

A dictionary (:class:`SparseAutoencoder`, :class:`Transcoder`) turns a layer's activation into
many mostly-zero feature activations and back (:mod:`handformer.features.dictionary` writes the
maths out).
"""

from handformer.features.dictionary import Dictionary, SparseAutoencoder, Transcoder

__all__ = ["Dictionary", "SparseAutoencoder", "Transcoder"]
