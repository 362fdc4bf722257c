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

With one transcoder per layer, :func:`attribution_graph` traces a prompt's circuit (the
local replacement model, :mod:`handformer.features.graph`): direct effects between features,
error nodes, token embeddings and logits, pruned by influence, scored, checked in the real
model by :func:`intervene`, saved for circuit-tracer's page (:func:`save_graph_json`), drawn
(:func:`draw_graph`) or explored in an interactive page (:func:`save_graph_html`, and
``handformer serve --graph / --transcoders``); :func:`qk_attribution` says why a head attends
where it does. :func:`load_transcoder_set` reads one transcoder per layer from one path.

    graph = attribution_graph(model, transcoders, ids, max_feature_nodes=2000)
    kept = graph.prune(node_threshold=0.8, edge_threshold=0.98)
"""

from handformer.features.attach import Splice, attach, detach, splices
from handformer.features.dictionary import Dictionary, SparseAutoencoder, Transcoder
from handformer.features.files import DictionaryFileError
from handformer.features.graph import AttributionGraph, attribution_graph
from handformer.features.graph_draw import draw_graph
from handformer.features.graph_io import GraphFileError, load_graph_json, save_graph_json
from handformer.features.graph_view import (
    graph_feature_cards,
    graph_view_data,
    render_graph_html,
    save_graph_html,
)
from handformer.features.influence import Pruned
from handformer.features.interventions import Intervention, intervene
from handformer.features.qk import (
    FactoredMatrix,
    QKAttribution,
    head_ov,
    head_qk,
    qk_attribution,
)
from handformer.features.replacement import ReplacementModel
from handformer.features.store import detect_format, load_dictionary, save_dictionary
from handformer.features.transcoder_set import load_transcoder_set

__all__ = ["Dictionary", "SparseAutoencoder", "Transcoder", "load_dictionary",
           "save_dictionary", "detect_format", "DictionaryFileError", "attach", "detach",
           "splices", "Splice", "attribution_graph", "AttributionGraph", "Pruned",
           "ReplacementModel", "qk_attribution", "QKAttribution", "head_ov", "head_qk",
           "FactoredMatrix", "intervene", "Intervention", "save_graph_json",
           "load_graph_json", "GraphFileError", "draw_graph", "save_graph_html",
           "render_graph_html", "graph_view_data", "graph_feature_cards", "load_transcoder_set"]

# Training, metrics and using features (handformer.features.train / metrics / analysis).
from handformer.features.analysis import (  # noqa: E402
    feature_ablation_sweep,
    feature_cards,
    feature_logit_effects,
    feature_patching_sweep,
    steer,
)
from handformer.features.corpus import load_corpus  # noqa: E402
from handformer.features.metrics import (  # noqa: E402
    DictionaryMetrics,
    evaluate_dictionaries,
    evaluate_dictionary,
)
from handformer.features.train import train_dictionary, train_on_activations  # noqa: E402

__all__ += ["train_dictionary", "train_on_activations", "evaluate_dictionary",
            "evaluate_dictionaries",
            "DictionaryMetrics", "load_corpus", "steer", "feature_logit_effects",
            "feature_cards", "feature_ablation_sweep", "feature_patching_sweep"]
