"""The attribution-graph view's JSON API (:mod:`handformer.serve.graph` computes):

    GET  /api/graph                the graphs (``--graph`` files, then those computed), whether
                                   the server computes new ones (``--transcoders``) and its limits
    GET  /api/graph/view?graph=ID  one graph as the view draws it: circuit-tracer's graph JSON
                                   with the view's extras (default: the newest graph)
    POST /api/graph/compute        the graph of a prompt: ``text`` or ``ids``, ``target`` (a
                                   token as text or an id; default the most likely tokens),
                                   ``max_feature_nodes`` (``0..``:data:`MAX_FEATURE_NODES`);
                                   one at a time (a second gets 429 while one runs), computed
                                   in a worker thread so the server keeps answering
    POST /api/graph/card           a transcoder feature's card: ``layer``, ``feature`` (and
                                   optionally the ``graph`` it is shown for)

Bodies are checked like the other endpoints' (a 422 naming the field); without ``--graph`` or
``--transcoders`` the endpoints other than ``/api/graph`` answer 404 with how to start the
server with them.
"""

from __future__ import annotations

import json

import anyio

from handformer.serve.graph import (
    DEFAULT_FEATURE_NODES,
    MAX_FEATURE_NODES,
    MAX_GRAPH_TOKENS,
    GraphBusy,
    GraphSet,
)
from handformer.serve.validation import (
    RequestError,
    check_fields,
    check_model,
    int_field,
    parse_run,
)

__all__ = ["graph_routes", "parse_compute_body", "parse_target"]

_COMPUTE = {"model", "text", "ids", "target", "max_feature_nodes"}
_CARD = {"model", "graph", "layer", "feature"}
_HOW = ("no attribution graphs are served; start the server with handformer serve --graph "
        "FILE.json, or --model M --transcoders PATH to compute them")


def _graphs(request: object) -> GraphSet | None:
    return request.app.state.graphs


def parse_target(value: object, state: object) -> int | None:
    """The ``target`` field: None, a token id, or a text that is exactly one token.

    Args:
        value: the field's value.
        state: the model (its tokenizer and vocabulary).

    Raises:
        RequestError: naming ``target``.
    """
    if value is None or value == "":
        return None
    vocab = state.model.lm_head.out_features
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value < vocab:
            raise RequestError("target", f"token id {value} is not in 0..{vocab - 1}")
        return value
    if not isinstance(value, str):
        raise RequestError("target", f"must be a token (text) or a token id, got "
                                     f"{json.dumps(value)[:40]}")
    try:
        ids = state.tokenizer.encode(value, add_special_tokens=False)
    except ValueError as exc:
        raise RequestError("target", f"{json.dumps(value)[:40]}: {exc}") from None
    if len(ids) != 1:
        pieces = [state.tokenizer.decode([i]) for i in ids[:8]]
        raise RequestError("target", f"{json.dumps(value)[:40]} is {len(ids)} tokens "
                                     f"({json.dumps(pieces, ensure_ascii=False)[:80]}); name "
                                     "one token (mind the leading space) or give its id")
    return ids[0]


def parse_compute_body(body: dict[str, object], graphs: GraphSet, registry: object
                       ) -> dict[str, object]:
    """Check a ``/api/graph/compute`` body.

    Args:
        body: the JSON object.
        graphs: the graphs served (with transcoders).
        registry: the server's models.

    Returns:
        ``ids``, ``target`` (an id or None), ``max_feature_nodes``, ``notices``.

    Raises:
        RequestError: naming the first bad field.
    """
    from handformer.serve.compute import request_input

    check_fields(body, _COMPUTE)
    check_model(body, registry, graphs.state.name, "transcoders")
    state = graphs.state
    out: dict[str, object] = {
        "target": parse_target(body.get("target"), state),
        "max_feature_nodes": int_field(body, "max_feature_nodes", DEFAULT_FEATURE_NODES, 0,
                                  MAX_FEATURE_NODES)}
    req = parse_run({k: body[k] for k in ("text", "ids") if k in body}, state)
    enc = request_input(state, req)
    ids = enc.batch["input_ids"][0].tolist()
    if len(ids) > MAX_GRAPH_TOKENS:
        raise RequestError("ids" if "ids" in body else "text",
                           f"{len(ids)} tokens; a graph takes at most {MAX_GRAPH_TOKENS}")
    return out | {"ids": ids, "notices": enc.notices}


def _refuse_query(request: object, path: str, allowed: tuple[str, ...] = ()) -> None:
    for name in request.query_params:
        if name not in allowed:
            raise RequestError(name[:40], f"unknown query parameter; {path} takes "
                                          f"{', '.join(allowed) or 'none'}")


def _not_served() -> object:
    from starlette.responses import JSONResponse

    return JSONResponse({"error": _HOW, "field": None}, status_code=404)


def _entry(graphs: GraphSet, graph_id: object) -> object:
    if graph_id is not None and not isinstance(graph_id, str):
        raise RequestError("graph", f"must be a graph id (a string), got "
                                    f"{json.dumps(graph_id)[:40]}")
    try:
        return graphs.get(graph_id)
    except KeyError as exc:
        raise RequestError("graph", exc.args[0]) from None


async def api_graph(request: object) -> object:
    """``GET /api/graph``: the graphs and what computing one takes."""
    from starlette.responses import JSONResponse

    _refuse_query(request, "/api/graph")
    graphs = _graphs(request)
    if graphs is None:
        return JSONResponse({"graphs": [], "compute": False, "cards": False, "model": None,
                             "computing": None, "limits": None})
    return JSONResponse(graphs.describe())


async def api_graph_view(request: object) -> object:
    """``GET /api/graph/view?graph=ID``: the graph as the view draws it."""
    from starlette.responses import JSONResponse

    _refuse_query(request, "/api/graph/view", ("graph",))
    graphs = _graphs(request)
    if graphs is None:
        return _not_served()
    entry = _entry(graphs, request.query_params.get("graph"))
    served = request.app.state.served
    return JSONResponse(await served.in_thread(graphs.view, entry))


async def api_graph_compute(request: object) -> object:
    """``POST /api/graph/compute``: the graph of a prompt (one at a time, in a worker
    thread)."""
    from starlette.responses import JSONResponse

    from handformer.serve.routes import error, read_json

    _refuse_query(request, "/api/graph/compute")
    graphs = _graphs(request)
    if graphs is None or not graphs.can_compute:
        return _not_served() if graphs is None else error(
            404, "this server does not compute graphs; start it with --transcoders PATH")
    body = await read_json(request)
    served = request.app.state.served
    args = await served.in_thread(parse_compute_body, body, graphs, served.registry)

    def run() -> dict[str, object]:
        entry = graphs.compute(args["ids"], target=args["target"],
                               max_feature_nodes=args["max_feature_nodes"])
        return {"graph": entry.describe(), "timings": entry.graph.timings,
                "notices": args["notices"], "view": graphs.view(entry)}
    try:  # its own thread, outside the compute slots: the page's other views keep working
        result = await anyio.to_thread.run_sync(run)
    except GraphBusy as exc:
        return error(429, str(exc))
    return JSONResponse(result)


async def api_graph_card(request: object) -> object:
    """``POST /api/graph/card``: a transcoder feature's card."""
    from starlette.responses import JSONResponse

    from handformer.serve.routes import error, read_json

    _refuse_query(request, "/api/graph/card")
    graphs = _graphs(request)
    if graphs is None or not graphs.can_compute:
        return _not_served() if graphs is None else error(
            404, "feature cards need the transcoders: start the server with --transcoders PATH")
    body = await read_json(request)
    check_fields(body, _CARD)
    check_model(body, request.app.state.served.registry, graphs.state.name, "transcoders")
    graph_id = _entry(graphs, body["graph"]).id if "graph" in body else None
    n = len(graphs.transcoders)
    layer = int_field(body, "layer", None, 0, n - 1)
    tc = graphs.transcoders[layer]
    if tc is None:
        raise RequestError("layer", f"layer {layer} has no transcoder")
    feature = int_field(body, "feature", None, 0, tc.d_sae - 1)
    card = await request.app.state.served.in_thread(graphs.card, layer, feature)
    return JSONResponse({"graph": graph_id, "layer": layer, "feature": feature} | card)


def graph_routes() -> list[object]:
    """The Starlette routes of the graph view; their handlers read the graphs from
    ``request.app.state.graphs`` (a :class:`~handformer.serve.graph.GraphSet`, or None).

    Returns:
        A list of ``starlette.routing.Route``.
    """
    from starlette.routing import Route

    return [Route("/api/graph", api_graph),
            Route("/api/graph/view", api_graph_view),
            Route("/api/graph/compute", api_graph_compute, methods=["POST"]),
            Route("/api/graph/card", api_graph_card, methods=["POST"])]
