"""The Features view's JSON API (:mod:`handformer.serve.features` computes):

    GET  /api/features            the dictionaries served (an empty list without --dictionary)
    POST /api/features/active     the most active features at each token of a text
    POST /api/features/card       one feature's contexts, density and logit effects
    POST /api/features/intervene  the next token and a greedy continuation with one feature
                                  ablated or steered, beside the clean ones

Bodies are checked like the other endpoints' (a 422 naming the field): ``model`` (only the
model the dictionaries belong to), ``dictionary`` (a name from ``/api/features``; default the
first), ``text`` or ``ids`` (as ``/api/run``), ``feature`` (``0..d_sae-1``), ``top``
(``1..``:data:`MAX_TOP`), ``mode`` (``"ablate"`` or ``"steer"``), ``coefficient`` (a finite
number, ``|c| ≤`` :data:`MAX_COEFFICIENT`) and ``new_tokens`` (``0..``:data:`MAX_NEW_TOKENS`).
"""

from __future__ import annotations

import json
import math

from handformer.serve.features import FeatureSet, active_features, feature_card, intervene
from handformer.serve.validation import (
    RequestError,
    check_fields,
    check_model,
    int_field,
    parse_run,
)

__all__ = ["feature_routes", "MAX_TOP", "MAX_COEFFICIENT", "MAX_NEW_TOKENS", "parse_feature_body"]

MAX_TOP = 32
MAX_COEFFICIENT = 1000.0
MAX_NEW_TOKENS = 32
MODES = ("ablate", "steer")
_FIELDS = {
    "active": {"model", "dictionary", "text", "ids", "top"},
    "card": {"model", "dictionary", "feature"},
    "intervene": {"model", "dictionary", "text", "ids", "feature", "mode", "coefficient",
                  "new_tokens"},
}


def parse_feature_body(kind: str, body: dict[str, object], features: FeatureSet,
                       registry: object) -> dict[str, object]:
    """Check a Features request body of ``kind`` (``"active"``, ``"card"``, ``"intervene"``).

    Args:
        kind: which endpoint.
        body: the JSON object.
        features: the dictionaries served.
        registry: the server's models (:class:`~handformer.serve.registry.ModelRegistry`).

    Returns:
        The checked values: ``state`` (the model), ``dictionary`` (its name), and the
        endpoint's fields (``ids`` a list of token ids, ``notices`` where the text was cut).

    Raises:
        RequestError: naming the first bad field.
    """
    check_fields(body, _FIELDS[kind])
    name = check_model(body, registry, features.model_name, "dictionaries")
    dictionary = body.get("dictionary", features.names()[0])
    if not isinstance(dictionary, str) or dictionary not in features.dictionaries:
        raise RequestError("dictionary", f"{json.dumps(dictionary)[:60]} is not served here; "
                                         f"dictionaries: {', '.join(features.names())}")
    out: dict[str, object] = {"dictionary": dictionary}
    d = features.dictionaries[dictionary]
    if "feature" in _FIELDS[kind]:
        out["feature"] = int_field(body, "feature", None, 0, d.d_sae - 1)
    if kind == "active":
        out["top"] = int_field(body, "top", 8, 1, MAX_TOP)
    if kind == "intervene":
        mode = body.get("mode", "ablate")
        if mode not in MODES:
            raise RequestError("mode", f"must be one of {', '.join(MODES)}, got "
                                       f"{json.dumps(mode)[:40]}")
        c = body.get("coefficient", 0.0 if mode == "ablate" else None)
        if mode == "steer" and c is None:
            raise RequestError("coefficient", "is missing; steering adds coefficient · "
                                              "W_dec[feature]")
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) \
                or abs(c) > MAX_COEFFICIENT:
            raise RequestError("coefficient", f"must be a finite number in "
                                              f"-{MAX_COEFFICIENT:g}..{MAX_COEFFICIENT:g}, got "
                                              f"{json.dumps(c)[:40]}")
        if mode == "ablate" and c != 0:
            raise RequestError("coefficient", "applies to mode \"steer\"; ablation zeroes the "
                                              "feature")
        out |= {"mode": mode, "coefficient": float(c),
                "new_tokens": int_field(body, "new_tokens", 8, 0, MAX_NEW_TOKENS)}
    # The model is loaded by now (it is the first one, loaded at start).
    state = registry.get(name)
    out["state"] = state
    if "text" in _FIELDS[kind]:
        from handformer.serve.compute import request_input

        req = parse_run({k: body[k] for k in ("text", "ids") if k in body}, state)
        enc = request_input(state, req)
        out |= {"ids": enc.batch["input_ids"][0].tolist(), "tokens": enc.tokens,
                "notices": enc.notices}
    return out


def _features(request: object) -> FeatureSet | None:
    return request.app.state.features


def _refuse_query(request: object, path: str) -> None:
    if request.query_params:
        raise RequestError(next(iter(request.query_params)),
                           f"unknown query parameter; {path} takes none")


async def api_features(request: object) -> object:
    """``GET /api/features``: the dictionaries served (none without ``--dictionary``)."""
    from starlette.responses import JSONResponse

    _refuse_query(request, "/api/features")
    features = _features(request)
    if features is None:
        return JSONResponse({"model": None, "dictionaries": []})
    return JSONResponse({"model": features.model_name, "dictionaries": features.describe()})


def _active(state: object, features: FeatureSet, a: dict) -> dict[str, object]:
    return {"tokens": a["tokens"], "notices": a["notices"]} | active_features(
        state, features, a["dictionary"], a["ids"], a["top"])


def _card(state: object, features: FeatureSet, a: dict) -> dict[str, object]:
    return {"feature": a["feature"]} | feature_card(state, features, a["dictionary"],
                                                    a["feature"])


def _intervene(state: object, features: FeatureSet, a: dict) -> dict[str, object]:
    result = intervene(state, features, a["dictionary"], a["ids"], a["feature"],
                       mode=a["mode"], coefficient=a["coefficient"], new_tokens=a["new_tokens"])
    result["notices"] = a["notices"] + result["notices"]
    return {"feature": a["feature"], "mode": a["mode"], "coefficient": a["coefficient"]} | result


async def _post(request: object, kind: str, compute: object) -> object:
    """Check the body of ``/api/features/KIND`` and run ``compute`` in a compute slot."""
    from starlette.responses import JSONResponse

    from handformer.serve.routes import read_json

    _refuse_query(request, f"/api/features/{kind}")
    features, served = _features(request), request.app.state.served
    if features is None:
        return JSONResponse({"error": "no dictionaries are served; start the server with "
                                      "handformer serve --model M --dictionary PATH",
                             "field": None}, status_code=404)
    body = await read_json(request)

    def answer() -> dict[str, object]:
        args = parse_feature_body(kind, body, features, served.registry)
        state = args["state"]
        head = {"model": state.name, "dictionary": args["dictionary"],
                "hook": features.dictionaries[args["dictionary"]].hook_name}
        return head | compute(state, features, args)
    return JSONResponse(await served.in_thread(answer))


async def api_features_active(request: object) -> object:
    """``POST /api/features/active``: the most active features at each token."""
    return await _post(request, "active", _active)


async def api_features_card(request: object) -> object:
    """``POST /api/features/card``: one feature's contexts, density and logit effects."""
    return await _post(request, "card", _card)


async def api_features_intervene(request: object) -> object:
    """``POST /api/features/intervene``: one feature ablated or steered, beside the clean
    run."""
    return await _post(request, "intervene", _intervene)


def feature_routes() -> list[object]:
    """The Starlette routes of the Features view; their handlers read the dictionaries from
    ``request.app.state.features`` (None: ``/api/features`` lists none and the POST endpoints
    answer 404 with how to start the server with dictionaries) and the models and compute
    slots from ``request.app.state.served``.

    Returns:
        A list of ``starlette.routing.Route``.
    """
    from starlette.routing import Route

    return [Route("/api/features", api_features),
            Route("/api/features/active", api_features_active, methods=["POST"]),
            Route("/api/features/card", api_features_card, methods=["POST"]),
            Route("/api/features/intervene", api_features_intervene, methods=["POST"])]
