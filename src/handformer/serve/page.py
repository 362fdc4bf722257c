"""The page ``GET /`` returns: the attention viewer of :mod:`handformer.viz` (the same HTML,
CSS and JavaScript as ``index.html``, not a copy) with the server's controls added.

The viewer page inlines its styles and script; the Content-Security-Policy allows exactly
those inline blocks by their SHA-256 hashes, plus ``/static/`` files of this package, and
nothing from any other origin. ``/static/graph.js`` and ``/static/graph.css`` are the
attribution-graph view (:mod:`handformer.viz.graph_page`). The controls' script,
``/static/serve.js``, is the files of
:data:`SERVE_SCRIPTS` in ``static/`` joined in that order inside one function (as the viewer's
script is; see ``static/serve.js``). The page is built once at start-up around an example run.
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib import resources

from handformer.serve import compute
from handformer.serve.state import ModelState
from handformer.serve.validation import RunRequest

__all__ = ["build_page", "STATIC_FILES", "SERVE_SCRIPTS", "static_files", "serve_script"]

EXAMPLE = "The animal didn't cross the street because it was too tired"
# The files served under /static/: name -> content type. Nothing else is ever read.
STATIC_FILES = {"serve.js": "text/javascript; charset=utf-8",
                "graph.js": "text/javascript; charset=utf-8",
                "graph.css": "text/css; charset=utf-8"}
# /static/serve.js, in this order: the state, requests and runs; the attribution and head grid;
# generation and chat; the Features view; the graph view's controls; the model picker and the
# start-up (see static/serve.js). /static/graph.js and graph.css are the attribution-graph
# view of handformer.viz.graph_page (the same files a saved graph page inlines).
SERVE_SCRIPTS = ("serve.js", "serve_heads.js", "serve_generate.js", "serve_features.js",
                 "serve_graph.js", "serve_models.js")

_INLINE = re.compile(r"<(script|style)>(.*?)</\1>", re.DOTALL)


def _asset(name: str) -> str:
    return resources.files("handformer.serve").joinpath("static", name).read_text(
        encoding="utf-8")


def serve_script() -> str:
    """``/static/serve.js``: the files of :data:`SERVE_SCRIPTS` joined inside one function."""
    from handformer.viz.html import join_scripts

    return join_scripts([_asset(name) for name in SERVE_SCRIPTS])


def static_files() -> dict[str, tuple[bytes, str]]:
    """The static files, built once: name -> (bytes, content type)."""
    from handformer.viz.graph_page import graph_css, graph_script

    texts = {"serve.js": serve_script(), "graph.js": graph_script(), "graph.css": graph_css()}
    return {name: (texts[name].encode("utf-8"), kind) for name, kind in STATIC_FILES.items()}


def example_text(state: ModelState) -> str:
    """A text the model's tokenizer accepts: the seed sentence, or one made of its tokens."""
    try:
        compute.encode(state, EXAMPLE)
        return EXAMPLE
    except ValueError:
        tokenizer = state.tokenizer  # the first tokens of the vocabulary, as text
        pieces = [tokenizer.decode([i]) for i in range(min(256, len(tokenizer)))]
        return ("".join(p for p in pieces if p.isprintable())[:24]
                or tokenizer.decode(list(range(min(8, len(tokenizer))))))


def _insert(page: str, marker: str, text: str, *, before: bool) -> str:
    if page.count(marker) != 1:
        raise RuntimeError(f"the viewer page has {page.count(marker)} {marker!r}, expected 1")
    return page.replace(marker, text + marker if before else marker + text)


def build_page(state: ModelState, example: str) -> tuple[str, str]:
    """The page and its Content-Security-Policy header value.

    The page's one stylesheet is the viewer's ``viewer.css`` (inlined, with the controls'
    rules in it); ``/static/serve.js`` (:func:`serve_script`) adds the controls' behaviour.

    Args:
        state: the model the page opens on.
        example: the text of its first run.

    Returns:
        ``(html, csp)``.
    """
    from handformer.viz.html import viewer_page

    result = compute.run(state, RunRequest(example, None, state.default_attention, (),
                                           choose_head=True))
    page = viewer_page(result["viewer"], title=f"handformer serve: {state.name}")
    hashes = {"script": [], "style": []}
    for kind, body in _INLINE.findall(page):
        digest = base64.b64encode(hashlib.sha256(body.encode("utf-8")).digest()).decode()
        hashes[kind].append(f"'sha256-{digest}'")
    page = _insert(page, "</header>", "\n" + _asset("panel.html"), before=False)
    page = _insert(page, "</head>", '<link rel="stylesheet" href="/static/graph.css">\n',
                   before=True)
    page = _insert(page, "</body>", '<script src="/static/graph.js"></script>\n'
                   '<script src="/static/serve.js"></script>\n', before=True)
    csp = "; ".join([
        "default-src 'none'",
        "script-src 'self' " + " ".join(hashes["script"]),
        "style-src 'self' " + " ".join(hashes["style"]),
        "img-src 'self' data:",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ])
    return page, csp
