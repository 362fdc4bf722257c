"""The ASGI app: routes, request checks and the security headers.

Routes::

    GET  /                 the page (viewer + controls)
    GET  /static/NAME      serve.js (a fixed list; no path is read from a request)
    GET  /api/model        one model (``?model=NAME``, default the first): sizes, kinds
    GET  /api/models       the models served (``--model`` given several times), loaded or not
    GET  /api/heads        detector scores of every head (``?model=NAME``), once per model
    POST /api/run          attention (viewer data) + similarity / next token
    POST /api/ablate       effect of ablating heads
    POST /api/rollout      attention rollout (viewer data)
    POST /api/attribution  causal models: the next token's logit by component and by head
    GET/POST /api/features...  the Features view (serve.feature_routes), with --dictionary
    POST /api/generate     causal models: JSON lines, one per new token (one at a time per
                           client address: a second gets 429)

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

from handformer.serve import compute
from handformer.serve.attribution import attribution
from handformer.serve.generation import Generation
from handformer.serve.page import build_page, example_text, static_files
from handformer.serve.registry import ModelLoadError, ModelRegistry
from handformer.serve.state import ModelState
from handformer.serve.validation import (
    MAX_BODY,
    WEIGHT_FORMATS,
    BodyTooLarge,
    RequestError,
    parse_generate,
    parse_json,
    parse_run,
    parse_weights_format,
)
from handformer.serve.wire import BINARY_TYPE, binary_body, json_body

__all__ = ["create_app", "SecurityMiddleware", "require_starlette"]

COMPUTE_SLOTS = 2  # model computations at the same time (each in its own thread and context)
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


async def _read_body(request: object) -> bytes:
    """The body, refusing more than ``MAX_BODY`` bytes before reading them all."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY:
        raise BodyTooLarge(int(length))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise BodyTooLarge()
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(state: ModelState | ModelRegistry, *, allowed_hosts: set[str] | None = None,
               features: object = None) -> object:
    """The Starlette app serving ``state``'s model (or a registry's models).

    Args:
        state: the loaded model, or a :class:`~handformer.serve.registry.ModelRegistry`
            (several models, loaded when first asked for).
        allowed_hosts: accepted Host headers (e.g. ``{"127.0.0.1:8000", "localhost:8000"}``);
            None accepts any.
        features: the dictionaries of the Features view
            (:class:`~handformer.serve.features.FeatureSet`; ``/api/features/...``), or None.

    Returns:
        An ASGI application.

    Raises:
        ImportError: without starlette (``pip install handformer[serve]``).
    """
    require_starlette()
    import anyio
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    # Long texts are cut with a notice in the response; the tokenizer's warning is not needed.
    warnings.filterwarnings("ignore", message=r".*were truncated to", category=UserWarning)
    registry = state if isinstance(state, ModelRegistry) else ModelRegistry.single(state)
    state = registry.first
    example = example_text(state)
    page, csp = build_page(state, example)
    static = static_files()
    infos: dict[str, dict[str, object]] = {}

    def info_of(model: ModelState) -> dict[str, object]:
        if model.name not in infos:
            infos[model.name] = model.info() | {
                "example": example_text(model), "weight_formats": list(WEIGHT_FORMATS),
                "models": registry.names()}
        return infos[model.name]

    generating: set[str] = set()  # client addresses with a generation running
    # Model work runs in worker threads, at most COMPUTE_SLOTS at a time: torch already
    # spreads one forward over the cores, and more at once only makes them fight for them.
    slots = anyio.CapacityLimiter(COMPUTE_SLOTS)

    async def in_thread(fn: object, *args: object) -> object:
        return await anyio.to_thread.run_sync(fn, *args, limiter=slots)

    def error(status: int, message: str, field: str | None = None) -> JSONResponse:
        return JSONResponse({"error": " ".join(message.split()), "field": field},
                            status_code=status)

    async def index(request: object) -> Response:
        return HTMLResponse(page)

    async def static_file(request: object) -> Response:
        found = static.get(request.path_params["name"])  # a dict lookup, never a file path
        if found is None:
            return error(404, "no such static file")
        return Response(found[0], media_type=found[1],
                        headers={"cache-control": "no-cache"})

    def model_param(request: object) -> str:
        query = request.query_params.multi_items()
        for name, _ in query:
            if name != "model":
                raise RequestError(name[:40] or "(empty)", "unknown query parameter; the only "
                                                           "one is model")
        return registry.check_name(dict(query).get("model"))

    async def model_info(request: object) -> Response:
        name = model_param(request)
        return JSONResponse(info_of(await in_thread(registry.get, name)))

    async def models(request: object) -> Response:
        return JSONResponse({"default": registry.default, "models": registry.status()})

    async def heads(request: object) -> Response:
        from handformer.serve.detectors import head_scores

        name = model_param(request)
        model = await in_thread(registry.get, name)
        return JSONResponse({"model": model.name} | await in_thread(head_scores, model))

    class TwoPartResponse(Response):
        """A body sent as two chunks (the binary answer's header, then the weights as they
        are, without joining them into one more copy)."""

        def __init__(self, head: bytes, tail: memoryview) -> None:
            self.parts = (head, tail)
            super().__init__(None, media_type=BINARY_TYPE, headers={
                "content-length": str(len(head) + tail.nbytes), "cache-control": "no-store"})

        async def __call__(self, scope: dict, receive: object, send: object) -> None:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": self.parts[0], "more_body": True})
            await send({"type": "http.response.body", "body": self.parts[1]})

    def endpoint(path: str, compute_fn: object, *, weights: bool) -> object:
        async def handle(request: object) -> Response:
            fmt = parse_weights_format(request.query_params.multi_items(), path,
                                       accepts_weights=weights)
            body = parse_json(await _read_body(request))
            name = registry.check_name(body.get("model"))

            def answer(binary: bool) -> object:
                model = registry.get(name)
                result = compute_fn(model, parse_run(body, model), **(
                    {"binary": True} if binary else {}))
                return binary_body(result) if binary else json_body(result)

            if fmt == "binary":
                head, tail = await in_thread(answer, True)
                return TwoPartResponse(head, tail)
            return Response(await in_thread(answer, False), media_type="application/json")
        return handle

    async def generate(request: object) -> Response:
        parse_weights_format(request.query_params.multi_items(), "/api/generate",
                             accepts_weights=False)
        body = parse_json(await _read_body(request))
        name = registry.check_name(body.get("model"))
        client = request.client.host if request.client else "?"
        if client in generating:
            return error(429, "a generation is already running for this client; stop it (or "
                              "let it finish) before starting another")

        def begin() -> Generation:
            model = registry.get(name)
            return Generation(model, parse_generate(body, model))

        generating.add(client)
        try:
            gen = await in_thread(begin)
        except BaseException:
            generating.discard(client)
            raise

        async def lines():
            try:
                yield json.dumps(gen.start()) + "\n"
                while True:
                    try:
                        event = await in_thread(gen.step)
                    except Exception as exc:  # the status line is sent: report in-band
                        yield json.dumps({"event": "error",
                                          "error": " ".join(str(exc).split())})
                        return
                    yield json.dumps(event) + "\n"
                    if event["event"] == "end":
                        return
            finally:  # also when the client stops reading (the page's Stop button)
                generating.discard(client)

        return StreamingResponse(lines(), media_type="application/x-ndjson",
                                 headers={"cache-control": "no-cache"})

    async def on_request_error(request: object, exc: RequestError) -> Response:
        return error(422, str(exc), exc.field)

    async def on_too_large(request: object, exc: BodyTooLarge) -> Response:
        return error(413, str(exc))

    async def on_load_error(request: object, exc: ModelLoadError) -> Response:
        return error(503, str(exc), "model")

    async def on_not_implemented(request: object, exc: NotImplementedError) -> Response:
        return error(501, str(exc))

    async def on_http(request: object, exc: HTTPException) -> Response:
        return error(exc.status_code, exc.detail or "error")

    async def on_crash(request: object, exc: Exception) -> Response:
        return error(500, f"{type(exc).__name__}: {exc}")

    routes = [
        Route("/", index),
        Route("/static/{name}", static_file),
        Route("/api/model", model_info),
        Route("/api/models", models),
        Route("/api/heads", heads),
        Route("/api/run", endpoint("/api/run", compute.run, weights=True), methods=["POST"]),
        Route("/api/ablate", endpoint("/api/ablate", compute.ablate, weights=False),
              methods=["POST"]),
        Route("/api/rollout", endpoint("/api/rollout", compute.rollout, weights=True),
              methods=["POST"]),
        Route("/api/generate", generate, methods=["POST"]),
        Route("/api/attribution", endpoint("/api/attribution", attribution, weights=False),
              methods=["POST"]),
    ]
    from handformer.serve.feature_routes import feature_routes

    async def read_json(request: object) -> dict[str, object]:
        return parse_json(await _read_body(request))

    routes += feature_routes(features, registry, in_thread, read_json)
    app = Starlette(routes=routes, exception_handlers={
        RequestError: on_request_error, BodyTooLarge: on_too_large, ModelLoadError: on_load_error,
        NotImplementedError: on_not_implemented, HTTPException: on_http, Exception: on_crash})
    return SecurityMiddleware(app, csp=csp, allowed_hosts=allowed_hosts)
