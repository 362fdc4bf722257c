"""The server's routes are module-level handlers (handformer.serve.routes, feature_routes,
graph_routes), one per route,
that read what they share from their app (``request.app.state.served``): two apps in one
process share nothing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("starlette")

from handformer.serve import ModelState, feature_routes, graph_routes, routes  # noqa: E402
from handformer.serve.app import create_app  # noqa: E402
from serve_util import causal_folder  # noqa: E402

APP_DOC = Path(routes.__file__).with_name("app.py").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> ModelState:
    return ModelState(causal_folder(tmp_path_factory.mktemp("causal")))


def test_every_documented_route_has_a_module_level_handler(state: ModelState) -> None:
    documented = set(re.findall(r"^    (GET|POST) +(/\S*)", APP_DOC, re.M))
    app = create_app(state).app  # inside the security middleware
    served = {(method, route.path.replace("{name}", "NAME"))
              for route in app.routes for method in route.methods - {"HEAD"}}
    assert served == documented
    for route in app.routes:
        handler = route.endpoint
        module = (feature_routes if route.path.startswith("/api/features") else
                  graph_routes if route.path.startswith("/api/graph") else routes)
        assert handler.__module__ == module.__name__, route.path
        assert "<locals>" not in handler.__qualname__, route.path  # not a closure
        assert getattr(module, handler.__name__) is handler


def test_two_apps_share_no_state(state: ModelState) -> None:
    from starlette.testclient import TestClient

    first, second = create_app(state), create_app(state)
    a, b = first.app.state.served, second.app.state.served
    assert a is not b and a.generating is not b.generating and a.slots is not b.slots
    a.generating.add("testclient")  # the first app believes this client is generating
    with TestClient(first) as c1, TestClient(second) as c2:
        body = {"text": "ab", "max_new_tokens": 1, "text_only": True}
        assert c1.post("/api/generate", json=body).status_code == 429
        answer = c2.post("/api/generate", json=body)
        assert answer.status_code == 200, answer.text
    assert not b.generating  # the second app's generation ended and let the client go
