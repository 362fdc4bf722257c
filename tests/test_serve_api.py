"""``handformer serve`` as a user meets it: the real server in a subprocess, requests with httpx.

Answers are checked against direct Python calls that do not go through the server's code:
the bundled model loaded afresh with the attention kind built in, heads removed by zeroing
their output-projection columns (no hooks), embeddings by ``handformer.embed``.
"""

from __future__ import annotations

import base64
import json
import signal
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch

from handformer.attention.local import LocalAttention
from handformer.attention.sparse import StridedAttention
from handformer.pretrained import embed, load_bert
from handformer.serve.page import SERVE_SCRIPTS
from handformer.serve.wire import read_binary
from handformer.viz.html import VIEWER_SCRIPTS
from serve_util import ROOT, SEED, Server, cosine, raw_request, viewer_weights, zero_heads

PAIR = "A tired animal stayed on the pavement"


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def bert():
    return load_bert()


def similarity(model, tokenizer, a: str, b: str) -> float:
    e = embed([a, b], model=model, tokenizer=tokenizer)
    return cosine(e[0], e[1])


def test_banner_and_model_info(server, client):
    assert server.host == "127.0.0.1"
    assert "all-MiniLM-L6-v2" in server.banner
    info = client.get("/api/model").json()
    assert info["model"] == "all-MiniLM-L6-v2" and info["type"] == "encoder"
    assert (info["layers"], info["heads"], info["max_tokens"]) == (6, 12, 512)
    assert info["embed_tokens"] == 256  # sentence_bert_config.json's max_seq_length
    assert info["attention_kinds"] == ["full", "local", "strided", "linear"]
    assert info["default_attention"]["kind"] == "full"
    assert info["weight_formats"] == ["json", "binary"]


def test_run_matches_direct_call(client, bert):
    model, tokenizer = bert
    r = client.post("/api/run", json={"text": SEED, "text_pair": PAIR})
    assert r.status_code == 200
    body = r.json()
    assert body["model"] == "all-MiniLM-L6-v2" and body["attention"]["kind"] == "full"
    enc = tokenizer.encode_batch([SEED])
    assert body["tokens"] == enc[0].tokens
    assert body["similarity"] == pytest.approx(similarity(model, tokenizer, SEED, PAIR), abs=1e-6)
    with torch.inference_mode():
        ref = model(**tokenizer.pad(enc), need_weights=True).attentions
    ref = torch.stack([a[0] for a in ref]).double().numpy()  # (N, H, L, L)
    got = viewer_weights(body["viewer"])
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= 1.0 / 255  # 8-bit quantisation of [0, 1]


def parse_binary(body: bytes) -> tuple[dict, bytes]:
    """The ``?weights=binary`` format, read here from its description (not with serve.wire):
    b"HFW1", a little-endian uint32 header length, the JSON header, then the 8-bit codes."""
    magic, n = struct.unpack("<4sI", body[:8])
    assert magic == b"HFW1"
    return json.loads(body[8:8 + n].decode("utf-8")), body[8 + n:]


def quantised(attentions) -> np.ndarray:
    """The viewer's 8-bit codes of per-layer ``(1, H, L, L)`` weights, computed here the plain
    way: per head, ``rint((x - lo) * (255 / (hi - lo)))`` in float32, ``lo = min(0, min)``."""
    x = torch.stack([a[0] for a in attentions]).float().numpy()  # (N, H, L, L)
    lo = np.minimum(x.min(axis=(2, 3), keepdims=True), np.float32(0))
    hi = x.max(axis=(2, 3), keepdims=True)
    span = np.where(hi > lo, hi - lo, np.float32(1))
    return np.rint((x - lo) * (np.float32(255) / span)).astype(np.uint8)


@pytest.mark.parametrize("path, body", [
    ("/api/run", {"text": SEED, "text_pair": PAIR}),
    ("/api/run", {"text": SEED, "attention": "local", "window_size": 3, "heads": [[1, 2]]}),
    ("/api/rollout", {"text": SEED, "heads": [[0, 0]]}),
])
def test_binary_weights_are_the_json_answer_without_base64(client, path, body):
    plain = client.post(path, json=body).json()
    r = client.post(path + "?weights=binary", json=body)
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    assert int(r.headers["content-length"]) == len(r.content)
    header, codes = parse_binary(r.content)
    assert header["viewer"].pop("data") is None
    assert header["viewer"].pop("data_bytes") == len(codes)
    assert codes == base64.b64decode(plain["viewer"].pop("data"))  # the very same codes
    assert header == plain  # every other field too: model, attention kind, tokens...
    assert header["model"] == "all-MiniLM-L6-v2"
    assert header["attention"]["kind"] == body.get("attention", "full")
    assert read_binary(r.content)["viewer"]["data"].tobytes() == codes


def test_binary_weights_match_the_direct_call_quantised(client, bert):
    model, tokenizer = bert
    long = " ".join([SEED] * 40)  # cut to 512 tokens: 18.9 MB of codes
    header, codes = parse_binary(
        client.post("/api/run?weights=binary", json={"text": long}).content)
    assert len(header["tokens"]) == 512 and header["notices"]
    with torch.inference_mode(), pytest.warns(UserWarning, match="truncated"):
        ref = model(**tokenizer([long]), need_weights=True).attentions
    want = quantised(ref)  # (6, 12, 512, 512)
    got = np.frombuffer(codes, np.uint8).reshape(want.shape)
    # the server's forward pass runs in another process and thread: allow a code to land on
    # the other side of a rounding boundary, nothing more
    assert np.abs(got.astype(np.int16) - want).max() <= 1
    assert (got == want).mean() > 0.999
    scale = np.asarray(header["viewer"]["scale"]).reshape(6, 12, 2)
    x = torch.stack([a[0] for a in ref]).numpy()
    assert np.allclose(scale[..., 1], x.max(axis=(2, 3)), atol=1e-6)


@pytest.mark.parametrize("path, query, field, words", [
    ("/api/run", "weights=base64", "weights", "one of json, binary"),
    ("/api/rollout", "weights=", "weights", "one of json, binary"),
    ("/api/run", "weights=binary&weights=json", "weights", "2 times"),
    ("/api/run", "format=binary", "format", "unknown query parameter; the only one is weights"),
    ("/api/ablate", "weights=binary", "weights", "/api/ablate takes none"),
    ("/api/generate", "weights=json", "weights", "/api/generate takes none"),
])
def test_bad_query_parameters_are_422_naming_them(client, path, query, field, words):
    r = client.post(f"{path}?{query}", json={"text": SEED})
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["field"] == field and body["error"].startswith(field + ":")
    assert words in body["error"] and "\n" not in body["error"]


def test_binary_errors_are_json(client):
    r = client.post("/api/run?weights=binary", json={"text": ""})
    assert r.status_code == 422 and r.json()["field"] == "text"


@pytest.mark.parametrize("kind, options, reference", [
    ("local", {"window_size": 3}, lambda: LocalAttention(3)),
    ("strided", {"stride": 2, "global_tokens": 1}, lambda: StridedAttention(2, global_tokens=1)),
])
def test_attention_kinds_match_a_model_built_with_them(client, kind, options, reference):
    model, tokenizer = load_bert(attention=reference())
    body = client.post("/api/run", json={"text": SEED, "text_pair": PAIR, "attention": kind,
                                         **options}).json()
    assert body["attention"]["kind"] == kind
    assert all(body["attention"][k] == v for k, v in options.items())
    assert body["similarity"] == pytest.approx(similarity(model, tokenizer, SEED, PAIR), abs=1e-6)
    assert body["viewer"]["pattern"] is not None  # the reachable keys are drawn
    with torch.inference_mode():
        ref = model(**tokenizer([SEED]), need_weights=True).attentions
    got = viewer_weights(body["viewer"])
    assert np.abs(got - torch.stack([a[0] for a in ref]).numpy()).max() <= 1.0 / 255
    assert body["viewer"]["note"].startswith("all-MiniLM-L6-v2 · " + kind)


def test_linear_and_full_differ_and_say_so(client):
    full = client.post("/api/run", json={"text": SEED, "text_pair": PAIR}).json()
    linear = client.post("/api/run", json={"text": SEED, "text_pair": PAIR,
                                           "attention": "linear"}).json()
    assert linear["attention"]["kind"] == "linear"
    assert abs(linear["similarity"] - full["similarity"]) > 1e-3


def test_ablate_matches_zeroed_weights(client, bert):
    model, tokenizer = bert
    heads = [(0, 3), (2, 7), (5, 11)]
    body = client.post("/api/ablate", json={"text": SEED, "text_pair": PAIR,
                                            "heads": [list(h) for h in heads]}).json()
    assert body["metric"] == "similarity" and body["heads_ablated"] == [list(h) for h in heads]
    assert body["clean"] == pytest.approx(similarity(model, tokenizer, SEED, PAIR), abs=1e-6)
    cut = zero_heads(model, heads)
    assert body["ablated"] == pytest.approx(similarity(cut, tokenizer, SEED, PAIR), abs=1e-6)
    assert body["delta"] == pytest.approx(body["ablated"] - body["clean"], abs=1e-12)
    assert abs(body["delta"]) > 1e-5
    # without a pair: how far the embedding moves
    alone = client.post("/api/ablate", json={"text": SEED, "heads": [[0, 3]]}).json()
    assert alone["metric"] == "self_similarity"
    e = embed([SEED], model=model, tokenizer=tokenizer)[0]
    e_cut = embed([SEED], model=zero_heads(model, [(0, 3)]), tokenizer=tokenizer)[0]
    assert alone["ablated"] == pytest.approx(cosine(e, e_cut), abs=1e-6)


def test_run_with_ablation_changes_the_attention_of_later_layers(client, bert):
    model, tokenizer = bert
    body = client.post("/api/run", json={"text": SEED, "heads": [[1, 4]]}).json()
    with torch.inference_mode():
        ref = zero_heads(model, [(1, 4)])(**tokenizer([SEED]), need_weights=True).attentions
    got = viewer_weights(body["viewer"])
    assert np.abs(got - torch.stack([a[0] for a in ref]).numpy()).max() <= 1.0 / 255
    assert "1 head ablated" in body["viewer"]["note"]


def test_32_concurrent_requests_with_different_ablations(server, bert):
    model, tokenizer = bert
    rng = np.random.default_rng(0)
    jobs = []
    for i in range(32):
        heads = sorted({(int(rng.integers(6)), int(rng.integers(12))) for _ in range(1 + i % 4)})
        kind = ["full", "local"][i % 2]
        jobs.append((heads, kind))

    def ask(job):
        heads, kind = job
        with httpx.Client(base_url=server.url, timeout=300) as c:
            window = {"window_size": 5} if kind == "local" else {}  # only with local
            return c.post("/api/ablate", json={"text": SEED, "text_pair": PAIR,
                                               "attention": kind, **window,
                                               "heads": [list(h) for h in heads]}).json()

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(ask, jobs))
    local_model, _ = load_bert(attention=LocalAttention(5))
    for (heads, kind), body in zip(jobs, answers, strict=True):
        assert body["heads_ablated"] == [list(h) for h in heads]
        assert body["attention"]["kind"] == kind
        base = model if kind == "full" else local_model
        expected = similarity(zero_heads(base, heads), tokenizer, SEED, PAIR)
        assert body["ablated"] == pytest.approx(expected, abs=1e-6), (heads, kind)
    assert len({round(b["ablated"], 9) for b in answers}) > 20  # really different answers


def test_long_text_is_cut_with_a_notice(client, bert):
    model, tokenizer = bert
    long = " ".join([SEED] * 40)
    body = client.post("/api/run", json={"text": long, "text_pair": PAIR}).json()
    assert len(body["tokens"]) == 512  # the attention view: the position table's limit
    assert body["notices"][0].startswith("text has ") and "limit of 512" in body["notices"][0]
    assert "sentence-embedding limit of 256" in body["notices"][1]
    with pytest.warns(UserWarning, match="truncated to 256"):  # what embed() does
        expected = similarity(model, tokenizer, long, PAIR)
    assert body["similarity"] == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("payload, field, words", [
    ({"text": ""}, "text", "empty"),
    ({"text": "   "}, "text", "empty"),
    ({}, "text", "missing"),
    ({"text": 5}, "text", "string"),
    ({"text": "hi", "attention": "sparse"}, "attention", "one of"),
    ({"text": "hi", "attention": "local", "window_size": 0}, "window_size", "positive"),
    ({"text": "hi", "attention": "local", "window_size": "5"}, "window_size", "integer"),
    ({"text": "hi", "attention": "local", "window_size": 4}, "window_size", "odd"),
    ({"text": "hi", "attention": "strided", "stride": True}, "stride", "integer"),
    ({"text": "hi", "heads": [[6, 0]]}, "heads", "out of range"),
    ({"text": "hi", "heads": [[0]]}, "heads", "pair"),
    ({"text": "hi", "heads": "0,1"}, "heads", "list"),
    ({"text": "hi", "txt": "x"}, "txt", "unknown field"),
    ({"text": "hi", "text_pair": 3}, "text_pair", "string"),
])
def test_bad_fields_are_422_naming_the_field(client, payload, field, words):
    for path in ("/api/run", "/api/ablate", "/api/rollout"):
        r = client.post(path, json=payload)
        assert r.status_code == 422, (path, r.text)
        body = r.json()
        assert body["field"] == field
        assert body["error"].startswith(field + ":") and words in body["error"]
        assert "\n" not in body["error"]


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"", b"\xff\xfe", b'"text"'])
def test_invalid_json_is_422(client, content):
    r = client.post("/api/run", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert r.json()["field"] is None and "\n" not in r.json()["error"]


def test_body_over_64_kib_is_413(client):
    big = json.dumps({"text": "a " * 40000}).encode()
    assert len(big) > 64 * 1024
    r = client.post("/api/run", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "65536" in r.json()["error"]

    def chunks():  # no Content-Length: the server counts while reading
        for _ in range(40):
            yield b"x" * 2048

    r = client.post("/api/run", content=chunks())
    assert r.status_code == 413
    ok = json.dumps({"text": "a " * 30000}).encode()  # under the limit: answered, cut
    assert client.post("/api/run", content=ok).status_code == 200


def test_generate_on_an_encoder_is_refused(client):
    r = client.post("/api/generate", json={"text": "hi"})
    assert r.status_code == 422 and "causal" in r.json()["error"]
    r = client.post("/api/attribution", json={"text": "hi"})
    assert r.status_code == 422 and "needs a causal language model" in r.json()["error"]


@pytest.mark.parametrize("path", [
    "/static/../state.py", "/static/%2e%2e/state.py", "/static/%2E%2E/app.py",
    "/static/..%2fpage.py", "/static/%2e%2e%2f%2e%2e%2fpyproject.toml", "/../../etc/passwd",
    "/static/..\\app.py", "/api/../static/serve.js",
])
def test_paths_cannot_escape(server, path):
    status, body = raw_request(server.port, f"GET {path} HTTP/1.1\r\nHost: "
                                            f"127.0.0.1:{server.port}\r\nConnection: close"
                                            "\r\n\r\n".encode())
    assert status in (400, 404), path
    assert b"import" not in body and b"root:" not in body


def test_static_files_and_page(client):
    js = client.get("/static/serve.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    # the files of static/, verbatim and in order, inside one function (see static/serve.js)
    parts = [(ROOT / "src/handformer/serve/static" / name).read_text(encoding="utf-8")
             for name in SERVE_SCRIPTS]
    assert js.text == '"use strict";\n(function () {\n' + "\n".join(parts) + "})();\n"
    assert client.get("/static/state.py").status_code == 404
    assert client.get("/static/panel.html").status_code == 404  # only the listed files
    page = client.get("/")
    assert page.status_code == 200
    for name in VIEWER_SCRIPTS:  # the viewer's own script, not a copy of it
        assert (ROOT / "src/handformer/viz" / name).read_text(encoding="utf-8") in page.text
    assert "http://" not in page.text.replace("http://www.w3.org", "")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert "unsafe-inline" not in csp and "*" not in csp
    for r in (js, page, client.get("/api/model"), client.post("/api/run", json={})):
        assert r.headers["content-security-policy"] == csp
        assert r.headers["x-content-type-options"] == "nosniff"


def test_wrong_method_and_unknown_route(client):
    assert client.get("/api/run").status_code == 405
    assert client.get("/api/nothing").status_code == 404


def test_foreign_host_header_is_refused(server):
    r = httpx.get(server.url + "/api/model", headers={"host": "attacker.example"})
    assert r.status_code == 400 and "Host" in r.json()["error"]


def test_hostile_text_is_returned_as_data(client):
    text = '<script>alert(1)</script> "><img src=x onerror=alert(2)>'
    body = client.post("/api/run", json={"text": text}).json()
    assert body["tokens"][1:4] == ["<", "script", ">"]
    assert client.get("/").headers["content-type"].startswith("text/html")


def test_port_in_use_exits_2_with_one_line(server):
    proc = subprocess.run([sys.executable, "-m", "handformer", "serve", "--port",
                           str(server.port)], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"port {server.port}" in lines[0] and "in use" in lines[0]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signals_stop_within_2_s(sig):
    s = Server()
    try:
        with httpx.Client(base_url=s.url) as c:  # an open keep-alive connection
            assert c.get("/api/model").status_code == 200
            code, seconds = s.stop(sig)
        assert code == 0 and seconds < 2.0
        assert "stopped" in s.proc.stdout.read()
        assert "Traceback" not in s.proc.stderr.read()
    finally:
        s.close()


def test_other_host_warns():
    s = Server("--host", "0.0.0.0")
    try:
        code, _ = s.stop()
        assert code == 0
        err = s.proc.stderr.read()
        assert err.startswith("warning: --host 0.0.0.0") and len(err.splitlines()) == 1
    finally:
        s.close()


def paper_rollout(attentions: list[torch.Tensor]) -> list[torch.Tensor]:
    """Abnar & Zuidema (2020) in float64: per layer the mean over heads, plus the identity
    for the residual, rows renormalised, multiplied through the layers; one result per depth."""
    out, total = [], None
    for a in attentions:
        mean = a[0].double().mean(0)  # (L, L)
        aug = 0.5 * mean + 0.5 * torch.eye(mean.shape[0], dtype=torch.float64)
        aug = aug / aug.sum(-1, keepdim=True)
        total = aug if total is None else aug @ total
        out.append(total)
    return out


def test_rollout_matches_the_paper_formula(client, bert):
    model, tokenizer = bert
    body = client.post("/api/rollout", json={"text": SEED}).json()
    assert body["model"] == "all-MiniLM-L6-v2" and body["attention"]["kind"] == "full"
    assert "attention rollout" in body["viewer"]["note"]
    with torch.inference_mode():
        attentions = model(**tokenizer([SEED]), need_weights=True).attentions
    want = torch.stack(paper_rollout(list(attentions))).numpy()  # (N, L, L)
    got = viewer_weights(body["viewer"])  # (N, 1, L, L): one "head" per depth
    assert got.shape == (6, 1, 15, 15)
    assert np.abs(got[:, 0] - want).max() <= 1.0 / 255
    # with a head ablated, the rollout is that of the ablated model
    cut = client.post("/api/rollout", json={"text": SEED, "heads": [[0, 0]]}).json()
    with torch.inference_mode():
        ablated = zero_heads(model, [(0, 0)])(**tokenizer([SEED]), need_weights=True)
    want = torch.stack(paper_rollout(list(ablated.attentions))).numpy()
    assert np.abs(viewer_weights(cut["viewer"])[:, 0] - want).max() <= 1.0 / 255
