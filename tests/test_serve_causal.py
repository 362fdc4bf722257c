"""``handformer serve --model DIR`` on a causal LM folder (a tiny random CausalLM with a
character vocabulary, saved like a training run): next-token answers, head ablation, and the
streamed generation with each new token's attention, against direct Python calls."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

import handformer as hf
from handformer.train.data import CharVocab
from serve_util import Server, causal_folder, zero_heads

PROMPT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return causal_folder(tmp_path_factory.mktemp("causal"))


@pytest.fixture(scope="module")
def server(folder):
    s = Server("--model", str(folder))
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def direct(folder):
    return hf.CausalLM.from_pretrained(folder).eval(), CharVocab.load(folder / "vocab.json")


def ids_of(vocab, text):
    return torch.tensor([vocab.encode(text)])


def test_model_info(client, folder):
    info = client.get("/api/model").json()
    assert info["type"] == "causal-lm" and info["model"] == folder.name
    assert (info["layers"], info["heads"], info["max_tokens"]) == (2, 4, 48)
    assert "/api/generate" in info["endpoints"]
    CharVocab.load(folder / "vocab.json").encode(info["example"])  # the example is typeable


def test_run_next_token_matches_direct(client, direct):
    model, vocab = direct
    body = client.post("/api/run", json={"text": PROMPT}).json()
    assert body["model_type"] == "causal-lm" and body["attention"]["kind"] == "full"
    assert body["tokens"] == [c.replace(" ", "\u2423") for c in PROMPT]
    with torch.inference_mode():
        probs = torch.softmax(model(ids_of(vocab, PROMPT)).logits[0, -1].double(), -1)
    top = torch.topk(probs, 5)
    assert [t["id"] for t in body["next_token"]] == top.indices.tolist()
    assert [t["prob"] for t in body["next_token"]] == pytest.approx(top.values.tolist(),
                                                                    abs=1e-6)
    assert body["viewer"]["pattern"] is not None  # the causal pattern beside the heat map


def test_ablate_next_token_matches_zeroed_weights(client, direct):
    model, vocab = direct
    heads = [(0, 1), (1, 3)]
    body = client.post("/api/ablate", json={"text": PROMPT,
                                            "heads": [list(h) for h in heads]}).json()
    assert body["metric"] == "next_token"
    with torch.inference_mode():
        clean = torch.softmax(model(ids_of(vocab, PROMPT)).logits[0, -1].double(), -1)
        cut = torch.softmax(zero_heads(model, heads)(ids_of(vocab, PROMPT)).logits[0, -1]
                            .double(), -1)
    assert [t["id"] for t in body["ablated"]] == torch.topk(cut, 5).indices.tolist()
    best = int(clean.argmax())
    assert body["top_token_prob"]["clean"] == pytest.approx(float(clean[best]), abs=1e-6)
    assert body["top_token_prob"]["ablated"] == pytest.approx(float(cut[best]), abs=1e-6)
    kl = float((clean * (clean.log() - cut.log())).sum())
    assert body["kl_divergence"] == pytest.approx(kl, rel=1e-4, abs=1e-9) and kl > 1e-4


def read_stream(client, payload):
    events = []
    with client.stream("POST", "/api/generate", json=payload) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        for line in r.iter_lines():
            if line.strip():
                events.append(json.loads(line))
    return events


@pytest.mark.parametrize("kind, heads", [("full", []), ("full", [[1, 2]]), ("local", []),
                                         ("linear", [[0, 0]])])
def test_generate_streams_tokens_with_their_attention(client, direct, kind, heads):
    model, vocab = direct
    window = {"window_size": 5} if kind == "local" else {}  # refused with other kinds
    events = read_stream(client, {"text": PROMPT, "max_new_tokens": 8, "attention": kind,
                                  **window, "heads": heads})
    assert events[0]["event"] == "start" and events[-1]["event"] == "end"
    assert events[0]["attention"]["kind"] == kind and events[0]["heads_ablated"] == heads
    tokens = [e for e in events if e["event"] == "token"]
    assert len(tokens) == 8
    # Reference: the model with that kind built in and the heads zeroed, rerun on the whole
    # text at every step (no cache), greedy.
    from handformer.serve.state import AttentionChoice, _layers

    ref = zero_heads(model, [tuple(h) for h in heads])
    for layer in _layers(ref):
        layer.attn.attention = AttentionChoice(kind, window_size=5).make()
    ids = vocab.encode(PROMPT)
    for step, event in enumerate(tokens):
        with torch.inference_mode():
            out = ref(torch.tensor([ids]), need_weights=True)
        expected = int(out.logits[0, -1].argmax())
        assert event["id"] == expected, step
        att = torch.tensor(event["attention"])  # (N, H, L)
        want = torch.stack([a[0, :, -1, :] for a in out.attentions])
        assert att.shape == want.shape == (2, 4, len(ids))
        assert torch.allclose(att, want.float(), atol=1e-4)
        ids.append(expected)
    assert events[-1]["text"] == vocab.decode(ids[len(PROMPT):])
    assert events[-1]["reason"] == "max_new_tokens"


def test_generate_near_the_context_end_is_cut_with_a_notice(client):
    text = "ab" * 22  # 44 of 48 positions
    events = read_stream(client, {"text": text, "max_new_tokens": 10})
    assert any("max_new_tokens cut to 4" in n for n in events[0]["notices"])
    assert sum(e["event"] == "token" for e in events) == 4
    assert events[-1]["reason"] == "context"


def test_generate_sampling_is_seeded(client):
    def text(seed):
        events = read_stream(client, {"text": PROMPT, "max_new_tokens": 12, "temperature": 1.5,
                                      "top_k": 10, "seed": seed})
        return events[-1]["text"]

    assert text(1) == text(1) != text(2)


@pytest.mark.parametrize("payload, field", [
    ({"text": "the CAT"}, "text"),  # "C", "A" are not in the character vocabulary
    ({"text": PROMPT, "text_pair": "a cat"}, "text_pair"),
    ({"text": PROMPT, "max_new_tokens": 0}, "max_new_tokens"),
    ({"text": PROMPT, "temperature": -1}, "temperature"),
    ({"text": PROMPT, "top_p": 1.5}, "top_p"),
    ({"text": PROMPT, "heads": [[2, 0]]}, "heads"),
])
def test_bad_fields(client, payload, field):
    # /api/run knows no generation options: it names them as unknown fields
    for path in ("/api/run", "/api/generate"):
        r = client.post(path, json=payload)
        assert r.status_code == 422, (path, r.text)
        assert r.json()["field"] == field


def test_long_prompt_is_cut_with_a_notice(client):
    body = client.post("/api/run", json={"text": "abc " * 30}).json()
    assert len(body["tokens"]) == 48 and "limit of 48" in body["notices"][0]


def test_local_trained_model_defaults_to_its_own_attention(tmp_path):
    folder = causal_folder(tmp_path / "local", attention="local", window_size=7)
    s = Server("--model", str(folder))
    try:
        with httpx.Client(base_url=s.url, timeout=120) as c:
            info = c.get("/api/model").json()
            assert info["default_attention"] == {"kind": "local", "window_size": 7,
                                                 "description": "local attention, window 7"}
            body = c.post("/api/run", json={"text": PROMPT}).json()
            assert body["attention"]["kind"] == "local"
            model = hf.CausalLM.from_pretrained(folder).eval()
            vocab = CharVocab.load(folder / "vocab.json")
            with torch.inference_mode():
                logits = model(ids_of(vocab, PROMPT)).logits[0, -1]
            assert body["next_token"][0]["id"] == int(logits.argmax())
    finally:
        s.close()


def test_gpt2_folder_with_a_tokenizer_json(tmp_path):
    pytest.importorskip("transformers")
    from handformer.pretrained import load_gpt2
    from pretrained_util import tiny_gpt2_folder

    EOS = 39  # tiny_gpt2_folder's <|endoftext|> with its default 40-word vocabulary
    tiny_gpt2_folder(tmp_path, n_layer=2)
    model, tokenizer = load_gpt2(tmp_path)
    s = Server("--model", str(tmp_path))
    try:
        with httpx.Client(base_url=s.url, timeout=120) as c:
            info = c.get("/api/model").json()
            assert info["type"] == "causal-lm" and info["max_tokens"] == 32
            body = c.post("/api/run", json={"text": "w1 w2 w3"}).json()
            with torch.inference_mode():
                logits = model(torch.tensor([[1, 2, 3]])).logits[0, -1]
            assert body["next_token"][0]["id"] == int(logits.argmax())
            events = read_stream(c, {"text": "w1 w2 w3", "max_new_tokens": 5})
            ids = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5,
                                 eos_token_id=EOS)[0, 3:].tolist()
            got = [e["id"] for e in events if e["event"] == "token"]
            assert got == (ids[:ids.index(EOS) + 1] if EOS in ids else ids)
            assert events[-1]["reason"] == ("eos" if EOS in ids else "max_new_tokens")
    finally:
        s.close()


def test_attribution_adds_up_to_the_top_logit(client, direct):
    model, vocab = direct
    body = client.post("/api/attribution", json={"text": PROMPT}).json()
    with torch.inference_mode():
        last = model(ids_of(vocab, PROMPT)).logits[0, -1]
    assert body["token"]["id"] == int(last.argmax())
    assert body["logit"] == pytest.approx(float(last.max()), abs=1e-4)
    assert sum(body["components"]["values"]) == pytest.approx(body["logit"], abs=1e-4)
    assert body["components"]["labels"][:2] == ["embed", "pos_embed"]
    heads = body["heads"]
    total = sum(sum(row) for row in heads["grid"]) + heads["remainder"] + heads["bias"]
    assert total == pytest.approx(body["logit"], abs=1e-4)
    assert len(heads["grid"]) == 2 and len(heads["grid"][0]) == 4
    assert "/api/attribution" in client.get("/api/model").json()["endpoints"]
