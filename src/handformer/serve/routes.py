"""The server's routes: one handler per route, each a function of the request.

What the handlers share -- the models, the page, the compute slots, the clients generating --
is one :class:`Served`, kept on the Starlette app as ``request.app.state.served`` by
:func:`~handformer.serve.app.create_app` (the routes themselves are listed in its module
docstring). This module imports starlette: it is imported only once
:func:`~handformer.serve.app.require_starlette` has passed.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import anyio
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from handformer.serve import compute
from handformer.serve.attribution import attribution
from handformer.serve.generation import Generation
from handformer.serve.page import example_text
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

__all__ = ["Served", "routes", "exception_handlers", "read_json"]


@dataclass
class Served:
    """What every handler of one app shares.

    Attributes:
        registry: the models served.
        page: the HTML of ``GET /``.
        static: ``/static/NAME`` files: name -> (bytes, media type).
        slots: model work runs in worker threads, this many at a time (torch already spreads
            one forward over the cores; more at once only makes them fight for them).
        template_slots: chat templates rendered at the same time, apart from model work.
        infos: ``GET /api/model``'s answer per model, computed once.
        generating: client addresses with a generation running.
    """

    registry: ModelRegistry
    page: str
    static: dict[str, tuple[bytes, str]]
    slots: anyio.CapacityLimiter
    template_slots: anyio.CapacityLimiter
    infos: dict[str, dict[str, object]] = field(default_factory=dict)
    generating: set[str] = field(default_factory=set)

    async def in_thread(self, fn: Callable[..., object], *args: object) -> object:
        """``fn(*args)`` in a worker thread, in one of the compute slots."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.slots)

    def info_of(self, model: ModelState) -> dict[str, object]:
        if model.name not in self.infos:
            self.infos[model.name] = model.info() | {
                "example": example_text(model), "weight_formats": list(WEIGHT_FORMATS),
                "models": self.registry.names()}
        return self.infos[model.name]


def _served(request: Request) -> Served:
    return request.app.state.served


def error(status: int, message: str, field: str | None = None) -> JSONResponse:
    """The JSON error answer: ``{"error": "one line", "field": field}``."""
    return JSONResponse({"error": " ".join(message.split()), "field": field},
                        status_code=status)


async def _read_body(request: Request) -> bytes:
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


async def read_json(request: Request) -> dict[str, object]:
    """The checked JSON body of ``request`` (size-bounded, nesting-bounded, an object).

    Args:
        request: the request.

    Returns:
        The parsed body.
    """
    return parse_json(await _read_body(request))


def _model_param(request: Request) -> str:
    """The ``?model=NAME`` of a GET (the default model without one); nothing else."""
    query = request.query_params.multi_items()
    for name, _ in query:
        if name != "model":
            raise RequestError(name[:40] or "(empty)", "unknown query parameter; the only "
                                                       "one is model")
    return _served(request).registry.check_name(dict(query).get("model"))


# ---- GET ------------------------------------------------------------------------------------

async def index(request: Request) -> Response:
    return HTMLResponse(_served(request).page)


async def static_file(request: Request) -> Response:
    found = _served(request).static.get(request.path_params["name"])  # a dict lookup, never
    if found is None:  # a file path
        return error(404, "no such static file")
    return Response(found[0], media_type=found[1], headers={"cache-control": "no-cache"})


async def api_model(request: Request) -> Response:
    served, name = _served(request), _model_param(request)
    return JSONResponse(served.info_of(await served.in_thread(served.registry.get, name)))


async def api_models(request: Request) -> Response:
    registry = _served(request).registry
    return JSONResponse({"default": registry.default, "models": registry.status()})


async def api_heads(request: Request) -> Response:
    from handformer.serve.detectors import head_scores

    served, name = _served(request), _model_param(request)
    model = await served.in_thread(served.registry.get, name)
    return JSONResponse({"model": model.name} | await served.in_thread(head_scores, model))


# ---- POST: one computation each -------------------------------------------------------------

class TwoPartResponse(Response):
    """A body sent as two chunks (the binary answer's header, then the weights as they are,
    without joining them into one more copy)."""

    def __init__(self, head: bytes, tail: memoryview) -> None:
        self.parts = (head, tail)
        super().__init__(None, media_type=BINARY_TYPE, headers={
            "content-length": str(len(head) + tail.nbytes), "cache-control": "no-store"})

    async def __call__(self, scope: dict, receive: object, send: object) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.parts[0], "more_body": True})
        await send({"type": "http.response.body", "body": self.parts[1]})


async def _compute(request: Request, path: str, compute_fn: Callable[..., object], *,
                   weights: bool) -> Response:
    """Check the query and the body, run ``compute_fn(model, request)`` in a compute slot and
    answer in JSON, or (``?weights=binary``, where ``weights``) a JSON header + raw bytes."""
    served = _served(request)
    fmt = parse_weights_format(request.query_params.multi_items(), path,
                               accepts_weights=weights)
    body = parse_json(await _read_body(request))
    name = served.registry.check_name(body.get("model"))

    def answer(binary: bool) -> object:
        model = served.registry.get(name)
        result = compute_fn(model, parse_run(body, model), **(
            {"binary": True} if binary else {}))
        return binary_body(result) if binary else json_body(result)

    if fmt == "binary":
        head, tail = await served.in_thread(answer, True)
        return TwoPartResponse(head, tail)
    return Response(await served.in_thread(answer, False), media_type="application/json")


async def api_run(request: Request) -> Response:
    return await _compute(request, "/api/run", compute.run, weights=True)


async def api_ablate(request: Request) -> Response:
    return await _compute(request, "/api/ablate", compute.ablate, weights=False)


async def api_rollout(request: Request) -> Response:
    return await _compute(request, "/api/rollout", compute.rollout, weights=True)


async def api_attribution(request: Request) -> Response:
    return await _compute(request, "/api/attribution", attribution, weights=False)


# ---- POST /api/generate: JSON lines, one generation per client at a time ---------------------

async def api_generate(request: Request) -> Response:
    served = _served(request)
    parse_weights_format(request.query_params.multi_items(), "/api/generate",
                         accepts_weights=False)
    body = parse_json(await _read_body(request))
    name = served.registry.check_name(body.get("model"))
    client = request.client.host if request.client else "?"
    if client in served.generating:
        return error(429, "a generation is already running for this client; stop it (or "
                          "let it finish) before starting another")
    served.generating.add(client)
    try:
        model = await served.in_thread(served.registry.get, name)
        # A chat's checks render the model's chat template: a stranger's program, bounded by
        # its budget (seconds), in its own slot, so that it never holds up model work.
        chat = body.get("messages") is not None
        req = await anyio.to_thread.run_sync(
            parse_generate, body, model,
            limiter=served.template_slots if chat else served.slots)
        gen = await served.in_thread(Generation, model, req)
    except BaseException:
        served.generating.discard(client)
        raise
    return StreamingResponse(_lines(served, gen, client), media_type="application/x-ndjson",
                             headers={"cache-control": "no-cache"})


async def _lines(served: Served, gen: Generation, client: str) -> AsyncIterator[str]:
    """The generation's JSON lines; the client may start another once this ends."""
    try:
        yield json.dumps(gen.start()) + "\n"
        while True:
            try:
                event = await served.in_thread(gen.step)
            except Exception as exc:  # the status line is sent: report in-band
                yield json.dumps({"event": "error", "error": " ".join(str(exc).split())})
                return
            yield json.dumps(event) + "\n"
            if event["event"] == "end":
                return
    finally:  # also when the client stops reading (the page's Stop button)
        served.generating.discard(client)


# ---- errors: one JSON line each ---------------------------------------------------------------

async def on_request_error(request: Request, exc: RequestError) -> Response:
    return error(422, str(exc), exc.field)


async def on_too_large(request: Request, exc: BodyTooLarge) -> Response:
    return error(413, str(exc))


async def on_load_error(request: Request, exc: ModelLoadError) -> Response:
    return error(503, str(exc), "model")


async def on_not_implemented(request: Request, exc: NotImplementedError) -> Response:
    return error(501, str(exc))


async def on_http(request: Request, exc: HTTPException) -> Response:
    return error(exc.status_code, exc.detail or "error")


async def on_crash(request: Request, exc: Exception) -> Response:
    return error(500, f"{type(exc).__name__}: {exc}")


def routes() -> list[Route]:
    """Every route and its handler."""
    return [
        Route("/", index),
        Route("/static/{name}", static_file),
        Route("/api/model", api_model),
        Route("/api/models", api_models),
        Route("/api/heads", api_heads),
        Route("/api/run", api_run, methods=["POST"]),
        Route("/api/ablate", api_ablate, methods=["POST"]),
        Route("/api/rollout", api_rollout, methods=["POST"]),
        Route("/api/generate", api_generate, methods=["POST"]),
        Route("/api/attribution", api_attribution, methods=["POST"]),
    ]


def exception_handlers() -> dict[type, Callable[..., object]]:
    """Each error becomes one JSON line with its status (an unexpected one: 500)."""
    return {RequestError: on_request_error, BodyTooLarge: on_too_large,
            ModelLoadError: on_load_error, NotImplementedError: on_not_implemented,
            HTTPException: on_http, Exception: on_crash}
