"""The ASGI app: its routes (handlers in :mod:`handformer.serve.routes` and
:mod:`handformer.serve.feature_routes`) and the security headers.

Routes::

    GET  /                 the page (viewer + controls)
    GET  /static/NAME      serve.js, graph.js, graph.css (a fixed list; no path is read from a
                           request)
    GET  /api/model        one model (``?model=NAME``, default the first): sizes, kinds
    GET  /api/models       the models served (``--model`` given several times), loaded or not
    GET  /api/heads        detector scores of every head (``?model=NAME``), once per model
    POST /api/run          attention (viewer data) + similarity / next token
    POST /api/ablate       effect of ablating heads
    POST /api/rollout      attention rollout (viewer data)
    POST /api/attribution  causal models: the next token's logit by component and by head
    POST /api/generate     causal models: JSON lines, one per new token (one at a time per
                           client address: a second gets 429)
    GET  /api/features     the dictionaries served (``--dictionary``; handlers in
                           :mod:`handformer.serve.feature_routes`)
    POST /api/features/active     the most active features at each token
    POST /api/features/card       one feature's contexts, density and logit effects
    POST /api/features/intervene  one feature ablated or steered
    GET  /api/graph        the attribution graphs served (``--graph``, ``--transcoders``;
                           handlers in :mod:`handformer.serve.graph_routes`)
    GET  /api/graph/view   one graph as the page's graph view draws it
    POST /api/graph/compute       the graph of a prompt (one at a time, in a worker thread)
    POST /api/graph/card          a transcoder feature's card

Every POST body may name ``"model"``; a model is loaded when first named (a failed load is a
503 naming the model and the cause; the server keeps serving the others).

``/api/run`` and ``/api/rollout`` take ``?weights=binary`` to receive the viewer's 8-bit
weights as raw bytes after a JSON header (:mod:`handformer.serve.wire`) instead of base64
inside the JSON; the page asks for that. Every answer names the model and the attention kind
that produced it. Errors are JSON ``{"error": "one line", "field": ...}`` with 413 (body over
64 KiB), 422 (bad JSON, field or query parameter), 400 (a path with ``..`` or encoded dots /
slashes), 404, 405 or 501.
"""

from __future__ import annotations

import json
import warnings

from handformer.serve.page import build_page, example_text, static_files
from handformer.serve.registry import ModelRegistry
from handformer.serve.state import ModelState

__all__ = ["create_app", "SecurityMiddleware", "require_starlette"]

COMPUTE_SLOTS = 2  # model computations at the same time (each in its own thread and context)
TEMPLATE_SLOTS = 1  # chat templates rendered at the same time (apart from the computations)
_BAD_PATH = (b"..", b"%2e", b"%2f", b"%5c", b"\\", b"%00", b"\x00")


def require_starlette() -> None:
    """Import check for the optional dependencies, with the install line on failure.

    Raises:
        ImportError: naming ``pip install handformer[serve]``.
    """
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"handformer serve needs starlette and uvicorn ({exc.name} is "
                          "missing): pip install handformer[serve]") from None


class SecurityMiddleware:
    """Refuses suspicious paths and adds the security headers to every HTTP response.

    Args:
        app: the ASGI app to wrap.
        csp: the Content-Security-Policy of every response.
        allowed_hosts: Host header values accepted (None = any), which stops DNS rebinding
            when the server listens on a loopback address.
    """

    def __init__(self, app: object, *, csp: str, allowed_hosts: set[str] | None) -> None:
        self.app, self.allowed_hosts = app, allowed_hosts
        self.headers = [(b"content-security-policy", csp.encode()),
                        (b"x-content-type-options", b"nosniff"),
                        (b"referrer-policy", b"no-referrer"),
                        (b"x-frame-options", b"DENY"),
                        (b"cross-origin-resource-policy", b"same-origin")]

    async def __call__(self, scope: dict, receive: object, send: object) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = (scope.get("raw_path") or scope["path"].encode("utf-8")).lower()
        reason = None
        if any(bad in raw for bad in _BAD_PATH) or ".." in scope["path"]:
            reason = (400, "the path may not contain '..', encoded dots or slashes")
        elif self.allowed_hosts is not None:
            host = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")
            if host.lower() not in self.allowed_hosts:
                reason = (400, f"unexpected Host header {host[:60]!r}; open the URL the "
                               "server printed")

        async def send_with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", [])) + self.headers
            await send(message)

        if reason is not None:
            body = json.dumps({"error": reason[1], "field": None}).encode()
            await send_with_headers({"type": "http.response.start", "status": reason[0],
                                     "headers": [(b"content-type", b"application/json"),
                                                 (b"content-length", str(len(body)).encode())]})
            await send_with_headers({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send_with_headers)


def create_app(state: ModelState | ModelRegistry, *, allowed_hosts: set[str] | None = None,
               features: object = None, graphs: object = None) -> object:
    """The Starlette app serving ``state``'s model (or a registry's models).

    The routes' handlers are functions of :mod:`handformer.serve.routes`; what they share is
    one :class:`~handformer.serve.routes.Served`, on the app as ``app.state.served``.

    Args:
        state: the loaded model, or a :class:`~handformer.serve.registry.ModelRegistry`
            (several models, loaded when first asked for).
        allowed_hosts: accepted Host headers (e.g. ``{"127.0.0.1:8000", "localhost:8000"}``);
            None accepts any.
        features: the dictionaries of the Features view
            (:class:`~handformer.serve.features.FeatureSet`), or None.
        graphs: the attribution graphs of the graph view
            (:class:`~handformer.serve.graph.GraphSet`), or None.

    Returns:
        An ASGI application.

    Raises:
        ImportError: without starlette (``pip install handformer[serve]``).
    """
    require_starlette()
    import anyio
    from starlette.applications import Starlette

    from handformer.serve.feature_routes import feature_routes
    from handformer.serve.graph_routes import graph_routes
    from handformer.serve.routes import Served, exception_handlers, routes

    # Long texts are cut with a notice in the response; the tokenizer's warning is not needed.
    warnings.filterwarnings("ignore", message=r".*were truncated to", category=UserWarning)
    registry = state if isinstance(state, ModelRegistry) else ModelRegistry.single(state)
    page, csp = build_page(registry.first, example_text(registry.first))
    served = Served(registry, page, static_files(), slots=anyio.CapacityLimiter(COMPUTE_SLOTS),
                    template_slots=anyio.CapacityLimiter(TEMPLATE_SLOTS))
    app = Starlette(routes=routes() + feature_routes() + graph_routes(),
                    exception_handlers=exception_handlers())
    app.state.served, app.state.features, app.state.graphs = served, features, graphs
    return SecurityMiddleware(app, csp=csp, allowed_hosts=allowed_hosts)
