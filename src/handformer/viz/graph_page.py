"""The attribution-graph view's page: its script, its stylesheet, and the self-contained HTML
file around one graph (no network: styles, script and data inline).

The view draws circuit-tracer's graph JSON (:mod:`handformer.features.graph_io`) with the
extras :func:`handformer.features.graph_view.graph_view_data` adds; the script is the files of
:data:`GRAPH_SCRIPTS` joined in that order inside one function (see ``graph_view.js``).
``handformer serve`` sends the same script and stylesheet as ``/static/graph.js`` and
``/static/graph.css``.
"""

from __future__ import annotations

import html
import re
from importlib import resources

from handformer.viz.html import _json_for_script, join_scripts

__all__ = ["GRAPH_SCRIPTS", "graph_script", "graph_css", "graph_page"]

GRAPH_SCRIPTS = ("graph_view.js", "graph_view_ui.js")
_PLACEHOLDER = re.compile(r"__HF_(TITLE|NOTE|CSS|JS|DATA)__")


def _asset(name: str) -> str:
    return resources.files("handformer.viz").joinpath(name).read_text(encoding="utf-8")


def graph_script() -> str:
    """The view's script: :data:`GRAPH_SCRIPTS` joined inside one function; it defines
    ``window.hfGraph`` (``mount(root, data, options)``) and draws a saved page's graph."""
    return join_scripts([_asset(name) for name in GRAPH_SCRIPTS])


def graph_css() -> str:
    """The view's stylesheet (its rules all start with ``.gv``)."""
    return _asset("graph_view.css")


def graph_page(payload: dict[str, object], *, title: str | None = None,
               note: str | None = None) -> str:
    """The self-contained page around one graph.

    Args:
        payload: the graph file with the view's extras (``graph_view_data``).
        title: the page title (default: the graph's slug).
        note: a line under the title.

    Returns:
        The complete HTML document (the viewer's stylesheet and the view's, inlined).
    """
    meta = payload.get("metadata") if isinstance(payload.get("metadata"), dict) else {}
    title = title or str(meta.get("slug") or "Attribution graph")
    parts = {"TITLE": html.escape(title), "NOTE": html.escape(note or ""),
             "CSS": _asset("viewer.css") + "\n" + graph_css(), "JS": graph_script(),
             "DATA": _json_for_script(payload)}
    return _PLACEHOLDER.sub(lambda m: parts[m.group(1)], _asset("graph_view.html"))
