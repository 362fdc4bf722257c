"""Features: sparse autoencoders and transcoders, loaded from what people publish, spliced
into a model.

A dictionary (:class:`SparseAutoencoder`, :class:`Transcoder`) turns a layer's activation into
many mostly-zero feature activations and back (:mod:`handformer.features.dictionary` writes the
maths out). :func:`load_dictionary` reads SAELens, Gemma Scope 1 and 2, sparsify,
circuit-tracer and handformer's own files from a local folder; :func:`save_dictionary` writes
handformer's. :func:`attach` splices dictionaries into a model, so that the features appear
among its hook points (``blocks.6.hook_resid_post.hook_sae_acts_post``) for
:func:`~handformer.inspect.run_with_cache`, hooks, ablation and patching.

    sae = load_dictionary("gemma-scope-2-270m-pt/resid_post/layer_9_width_16k_l0_small")
    with attach(model, sae):
        out, cache = run_with_cache(model, ids)
    acts = cache["blocks.9.hook_resid_post.hook_sae_acts_post"]  # (B, L, d_sae)
"""

from handformer.features.attach import Splice, attach, detach, splices
from handformer.features.dictionary import Dictionary, SparseAutoencoder, Transcoder
from handformer.features.files import DictionaryFileError
from handformer.features.graph import AttributionGraph, attribution_graph
from handformer.features.store import detect_format, load_dictionary, save_dictionary

__all__ = ["Dictionary", "SparseAutoencoder", "Transcoder", "load_dictionary",
           "save_dictionary", "detect_format", "DictionaryFileError", "attach", "detach",
           "splices", "Splice", "attribution_graph", "AttributionGraph"]
