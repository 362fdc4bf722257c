"""Look at attention: matplotlib heat maps and a self-contained interactive HTML viewer.

* :func:`plot_attention` - one head, tokens on both axes, colour bar; optionally the pattern
  of keys each query may reach (local / strided attention) beside it.
* :func:`plot_heads` - the model view: every layer x head as thumbnails.
* :func:`save_html` / :func:`render_html` - the viewer (heat map, head view, model view) as
  one HTML file that opens from disk with no network.
* :class:`AttentionView` - the viewer inline in a notebook.
* :func:`summarize` - per layer, which token gets the most attention and the strongest link.
* :func:`plot_rollout`, :func:`plot_faithfulness`, :func:`plot_logit_lens`,
  :func:`plot_similarity_lens` - pictures of what :mod:`handformer.inspect` computes;
  :func:`rollout_payload` - the rollout view of the HTML viewer (``save_html(rollout=...)``).
* :func:`plot_logit_attribution` (per component or per head), :func:`plot_head_scores`
  (layer x head) - direct logit attribution and head detectors of a causal LM.

All of them accept what handformer models return: ``out.attentions`` (one ``(B, H, L, L)``
tensor per layer), one layer's weights, or one head's ``(L, L)`` matrix.
"""

from handformer.viz.data import LayerSummary, as_attention_array, summarize
from handformer.viz.heatmap import MissingGlyphWarning, plot_attention, plot_heads, save_figure
from handformer.viz.html import render_html, save_html
from handformer.viz.inspect_plots import (
    plot_faithfulness,
    plot_logit_lens,
    plot_rollout,
    plot_similarity_lens,
)
from handformer.viz.llm_plots import plot_head_scores, plot_logit_attribution
from handformer.viz.notebook import AttentionView
from handformer.viz.rollout_view import rollout_payload

__all__ = [
    "plot_attention",
    "plot_heads",
    "save_figure",
    "save_html",
    "render_html",
    "AttentionView",
    "summarize",
    "LayerSummary",
    "as_attention_array",
    "MissingGlyphWarning",
    "plot_rollout",
    "plot_faithfulness",
    "plot_logit_lens",
    "plot_similarity_lens",
    "rollout_payload",
    "plot_logit_attribution",
    "plot_head_scores",
]
