"""The server against hostile or heavy requests, in-process (Starlette's test client on a tiny
causal LM): a chat template that would run for ever is refused while the server keeps
answering, deeply nested JSON is a 422 naming the field (no traceback in the real server's
log), and ``/api/generate`` streams text only when asked (``"text_only": true``), up to the
model's context instead of the viewer's limit."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from handformer.chat import template as chat_template
from handformer.chat.template import render_chat_template
from handformer.serve import ModelState
from handformer.serve.app import create_app
from serve_util import Server, causal_folder

PROMPT = "the cat sat on the mat"
# 4 million loop iterations: far over the budget's 100,000 steps, yet finite, so that the
# server without a budget renders it (in a few seconds) rather than hanging this test.
LOOPS = ("{% for a in range(2000) %}{% for b in range(2000) %}{% endfor %}{% endfor %}"
         "{% for m in messages %}{{ m.content }}{% endfor %}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return causal_folder(tmp_path_factory.mktemp("causal"))


@pytest.fixture()
def state(folder):
    return ModelState(folder)


def _client(app):  # noqa: ANN202 - a starlette TestClient
    from starlette.testclient import TestClient

    return TestClient(app)


def _lines(response) -> list[dict]:  # noqa: ANN001 - an httpx response
    return [json.loads(line) for line in response.text.splitlines() if line.strip()]


# ---- a chat template that would run for ever ------------------------------------------------


class _TemplateTokenizer:
    """The tiny model's character tokenizer with a chat template rendered by handformer's
    sandbox (as an instruct model's LMTokenizer does), named as if it came from evil.gguf."""

    def __init__(self, inner, template: str) -> None:  # noqa: ANN001
        self.inner, self.chat_template = inner, template

    def apply_chat_template(self, messages, *, add_generation_prompt=True):  # noqa: ANN001
        return render_chat_template(self.chat_template, messages, source="evil.gguf",
                                    add_generation_prompt=add_generation_prompt)

    def encode(self, text, add_special_tokens=True):  # noqa: ANN001
        return self.inner.encode(text)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


def _per_client(app):  # noqa: ANN001, ANN202 - ASGI apps
    """The client address from an ``x-client`` header (the test client has one address, and
    the server allows one generation per address)."""

    async def wrapped(scope, receive, send):  # noqa: ANN001, ANN202
        host = dict(scope.get("headers") or []).get(b"x-client")
        if scope["type"] == "http" and host:
            scope = dict(scope, client=(host.decode(), 1))
        await app(scope, receive, send)

    return wrapped


def test_a_template_being_refused_does_not_hold_up_the_server(state, monkeypatch):
    """Two clients send a chat whose template first waits (held here until the rest of the
    test has run), then loops for ever. Before the budget, the renderings held both compute
    slots: every model request waited. Now they render in their own slot, and the other
    requests are answered while they run; then both are refused in one line (422)."""
    gate, entered, timed_out = threading.Event(), threading.Semaphore(0), []

    def hold() -> str:
        entered.release()
        if not gate.wait(10):  # the test's requests never came back: let the templates go
            timed_out.append(True)
        return ""

    monkeypatch.setitem(chat_template._environment().globals, "hold", hold)
    state.tokenizer = _TemplateTokenizer(state.tokenizer, "{{ hold() }}" + LOOPS)
    chat = {"messages": [{"role": "user", "content": "the cat"}]}
    results: dict[str, object] = {}
    with _client(_per_client(create_app(state))) as client:
        def slow(name: str) -> None:
            try:
                results[name] = client.post("/api/generate", json=chat,
                                            headers={"x-client": name})
            except BaseException as exc:  # noqa: BLE001 - reported below, not lost
                results[name] = exc

        threads = [threading.Thread(target=slow, args=(name,)) for name in ("a", "b")]
        threads[0].start()
        assert entered.acquire(timeout=60)  # a's template is running
        threads[1].start()
        threading.Event().wait(0.3)  # b reaches its slot (before the budget: a compute slot)
        other = {"x-client": "c"}
        run = client.post("/api/run", json={"text": PROMPT}, headers=other)
        info = client.get("/api/model", headers=other)
        gen = client.post("/api/generate", json={"text": PROMPT, "max_new_tokens": 2},
                          headers=other)
        answered_while_held = not gate.is_set() and not timed_out
        gate.set()
        for t in threads:
            t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert answered_while_held
    assert run.status_code == 200 and len(run.json()["next_token"]) == 5
    assert info.status_code == 200 and info.json()["chat_template"] is True
    assert gen.status_code == 200 and _lines(gen)[-1]["event"] == "end"
    for name in ("a", "b"):
        refused = results[name]
        assert not isinstance(refused, BaseException), refused
        assert refused.status_code == 422 and refused.json()["field"] == "messages"
        assert refused.json()["error"] == (
            "messages: the chat template refused them: evil.gguf: chat template refused by the "
            "sandbox: it takes more than 100000 steps (loop iterations, calls, filters, "
            "operators), above the sandbox's limit")


# ---- deeply nested JSON -----------------------------------------------------------------------


DEEP = {"heads": b'{"text": "a", "heads": ' + b"[" * 5000,
        "messages": b'{"messages": [{"role": "user", "content": ' + b"{" * 40 + b"}" * 40
        + b"}]}"}


@pytest.mark.parametrize("field", DEEP)
def test_deeply_nested_json_is_422_naming_the_field(state, field, caplog):
    with _client(create_app(state)) as client:
        r = client.post("/api/run" if field == "heads" else "/api/generate",
                        content=DEEP[field], headers={"content-type": "application/json"})
        top = client.post("/api/run", content=b"[" * 5000)
        fine = client.post("/api/run", json={"text": PROMPT, "heads": [[0, 1]],
                                             "window_size": None})
    assert r.status_code == 422 and r.json() == {
        "field": field, "error": f"{field}: is nested deeper than 32 levels of [ and {{; no "
                                 "field needs more than 3"}
    assert top.status_code == 422 and top.json() == {
        "field": None, "error": "the request body is nested deeper than 32 levels of [ and {"}
    assert fine.status_code == 200
    assert not [rec for rec in caplog.records if rec.exc_info or "Traceback" in rec.message]


def test_deeply_nested_json_leaves_no_traceback_in_the_servers_log(folder):
    server = Server("--model", str(folder))
    try:
        import httpx

        with httpx.Client(base_url=server.url, timeout=60) as c:
            deep = c.post("/api/run", content=DEEP["heads"],
                          headers={"content-type": "application/json"})
            after = c.post("/api/run", json={"text": PROMPT})
        server.stop()
        log = server.proc.stderr.read()
    finally:
        server.close()
    assert deep.status_code == 422 and deep.json()["field"] == "heads"
    assert after.status_code == 200
    assert "Traceback" not in log and "RecursionError" not in log


# ---- text only ----------------------------------------------------------------------------------


def test_text_only_lines_carry_no_attention_and_the_same_tokens(state):
    with _client(create_app(state)) as client:
        full = client.post("/api/generate", json={"text": PROMPT, "max_new_tokens": 6})
        text = client.post("/api/generate", json={"text": PROMPT, "max_new_tokens": 6,
                                                  "text_only": True})
    full_lines, text_lines = _lines(full), _lines(text)
    assert text_lines[0]["event"] == "start" and text_lines[0]["text_only"] is True
    assert full_lines[0]["text_only"] is False
    tokens = [line for line in text_lines if line["event"] == "token"]
    assert len(tokens) == 6 and all("attention" not in line for line in tokens)
    with_weights = [line for line in full_lines if line["event"] == "token"]
    assert all(len(line["attention"]) == 2 for line in with_weights)  # N layers x H x L
    assert [t["id"] for t in tokens] == [t["id"] for t in with_weights]
    assert text_lines[-1]["text"] == full_lines[-1]["text"]
    # Against the model's own greedy decoding (no server code).
    ids = torch.tensor([state.tokenizer.encode(PROMPT)])
    direct = state.model.generate(ids, max_new_tokens=6)
    assert [t["id"] for t in tokens] == direct[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("kind", ["local", "linear"])
def test_text_only_decodes_with_the_cache_and_gets_the_same_tokens(state, kind):
    """Local and linear attention rerun the whole text when weights are sent (their caches
    keep no per-key weights); text only, they decode with their caches: same tokens."""
    body = {"text": PROMPT, "max_new_tokens": 8, "attention": kind}
    with _client(create_app(state)) as client:
        full = _lines(client.post("/api/generate", json=body))
        text = _lines(client.post("/api/generate", json=body | {"text_only": True}))
    assert [t["id"] for t in text if t["event"] == "token"] == [
        t["id"] for t in full if t["event"] == "token"]
    assert len([t for t in text if t["event"] == "token"]) == 8
    from handformer.serve.generation import Generation
    from handformer.serve.validation import parse_generate

    assert Generation(state, parse_generate(body, state)).cache is None
    assert Generation(state, parse_generate(body | {"text_only": True}, state)).cache is not None


def test_text_only_runs_to_the_models_context(state):
    """The viewer's limit (set to 16 tokens here; the context is 48) cuts a generation with
    attention; text only, the model's context is the limit."""
    state.max_tokens = 16
    prompt = "the cat"  # 7 tokens
    with _client(create_app(state)) as client:
        cut = _lines(client.post("/api/generate", json={"text": prompt, "max_new_tokens": 30}))
        text = _lines(client.post("/api/generate", json={"text": prompt, "max_new_tokens": 30,
                                                         "text_only": True}))
        too_many = client.post("/api/generate", json={"text": prompt, "max_new_tokens": 49,
                                                      "text_only": True})
        over_viewer = client.post("/api/generate", json={"text": prompt, "max_new_tokens": 513})
        boolean = client.post("/api/generate", json={"text": prompt, "attention": False})
        flag = client.post("/api/generate", json={"text": prompt, "text_only": "yes"})
    assert cut[-1] == {"event": "end", "reason": "context", "generated": 9,
                       "text": cut[-1]["text"]}
    assert "max_new_tokens cut to 9" in cut[0]["notices"][0]
    assert text[0]["notices"] == []
    assert text[-1]["event"] == "end" and text[-1]["generated"] == 30
    assert text[-1]["reason"] == "max_new_tokens"
    assert too_many.status_code == 422 and too_many.json()["error"] == (
        "max_new_tokens: must be in 1..48, got 49")
    assert over_viewer.status_code == 422 and "must be in 1..512" in over_viewer.json()["error"]
    assert boolean.status_code == 422 and boolean.json()["field"] == "attention"
    assert 'send "text_only": true' in boolean.json()["error"]
    assert flag.status_code == 422 and flag.json() == {
        "field": "text_only", "error": 'text_only: must be true or false, got "yes"'}
