"""``handformer serve`` with several models and under load: lazy loading, a model that fails to
load (503, the server keeps serving), one generation per client at a time (429), detector
scores (detect_heads' on the same probe, and a float64 recomputation), GQA and chat fields."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch

from handformer.serve import ModelState, compute
from handformer.serve.detectors import head_scores, probe_ids, scores_from_attention
from handformer.serve.registry import ModelLoadError, ModelRegistry, display_name
from handformer.serve.validation import RequestError, parse_generate, parse_run
from serve_util import Server, causal_folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    lm = causal_folder(root / "lm")
    broken = root / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "gpt2"}', encoding="utf-8")
    return lm, broken


@pytest.fixture(scope="module")
def server(folders):
    lm, broken = folders
    s = Server("--model", str(lm), "--model", str(broken), "--model", "all-MiniLM-L6-v2")
    yield s
    s.close()


def test_registry_loads_lazily_and_reports_failures(folders):
    lm, broken = folders
    loads = []

    def loader(source, *, device):
        loads.append(source)
        return ModelState(source, device=device)

    reg = ModelRegistry([str(lm), str(broken), None], loader=loader)
    assert reg.names() == ["lm", "broken", "all-MiniLM-L6-v2"]
    assert loads == [str(lm)]  # only the first at start
    assert [m["loaded"] for m in reg.status()] == [True, False, False]
    with pytest.raises(ModelLoadError, match="model 'broken' could not be loaded"):
        reg.get("broken")
    with pytest.raises(ModelLoadError):  # remembered, not retried
        reg.get("broken")
    assert loads.count(str(broken)) == 1
    assert reg.status()[1]["error"]
    assert reg.get("lm") is reg.first
    with pytest.raises(RequestError, match="'nope' is not served here; models: lm, broken"):
        reg.get("nope")
    with pytest.raises(ValueError, match="two models are named 'lm'"):
        ModelRegistry([str(lm), str(lm)], loader=loader)


def test_registry_concurrent_first_use_loads_once(folders):
    lm, _ = folders
    loads = []

    def loader(source, *, device):
        loads.append(source)
        return ModelState(source, device=device)

    reg = ModelRegistry([str(lm), None], loader=loader)
    got, errors = [], []
    together = threading.Barrier(4)  # the four first uses start at once

    def first_use() -> None:
        try:
            together.wait(timeout=60)
            got.append(reg.get("all-MiniLM-L6-v2"))
        except BaseException as exc:  # noqa: BLE001 - reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=first_use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a first use never returned"
    assert errors == []
    assert len(got) == 4 and len({id(g) for g in got}) == 1
    assert loads.count(None) == 1 and got[0].name == "all-MiniLM-L6-v2"


def test_display_names(tmp_path):
    assert display_name(None) == "all-MiniLM-L6-v2"
    assert display_name("gemma3-270m") == "gemma3-270m"
    (tmp_path / "x.gguf").write_bytes(b"")
    assert display_name(str(tmp_path / "x.gguf")) == "x.gguf"
    assert display_name(str(tmp_path)) == tmp_path.name


def test_server_switches_models_and_survives_a_failed_load(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        models = c.get("/api/models").json()
        assert [m["name"] for m in models["models"]] == ["lm", "broken", "all-MiniLM-L6-v2"]
        assert models["default"] == "lm"
        assert [m["loaded"] for m in models["models"]] == [True, False, False]
        bad = c.post("/api/run", json={"model": "broken", "text": "hi"})
        assert bad.status_code == 503 and bad.json()["field"] == "model"
        assert "model 'broken' could not be loaded" in bad.json()["error"]
        assert c.get("/api/model", params={"model": "broken"}).status_code == 503
        ok = c.post("/api/run", json={"model": "all-MiniLM-L6-v2", "text": "the cat"})
        assert ok.status_code == 200 and ok.json()["model"] == "all-MiniLM-L6-v2"
        assert c.post("/api/run", json={"text": "the cat"}).json()["model"] == "lm"
        info = c.get("/api/model", params={"model": "all-MiniLM-L6-v2"}).json()
        assert (info["type"], info["layers"], info["heads"], info["kv_heads"]) == (
            "encoder", 6, 12, 12)
        assert c.get("/api/model", params={"colour": "x"}).status_code == 422
        unknown = c.post("/api/run", json={"model": "nope", "text": "x"})
        assert unknown.status_code == 422 and unknown.json()["field"] == "model"
        status = c.get("/api/models").json()["models"]
        assert [m["loaded"] for m in status] == [True, False, True]
        assert status[1]["error"]


def test_one_generation_per_client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        with c.stream("POST", "/api/generate", json={"text": "the cat", "max_new_tokens": 40}
                      ) as first:
            lines = first.iter_lines()
            assert json.loads(next(lines))["event"] == "start"
            second = c.post("/api/generate", json={"text": "a dog", "max_new_tokens": 2})
            assert second.status_code == 429
            assert "already running for this client" in second.json()["error"]
        # the first one was closed early (the client stopped reading): the slot is free again
        for _ in range(50):
            again = c.post("/api/generate", json={"text": "a dog", "max_new_tokens": 2})
            if again.status_code != 429:
                break
            threading.Event().wait(0.1)
        assert again.status_code == 200
        assert json.loads(again.text.splitlines()[-1])["event"] == "end"


def test_request_size_limit_holds_with_several_models(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        r = c.post("/api/run", content=b'{"text": "' + b"a" * (70 * 1024) + b'"}',
                   headers={"content-type": "application/json"})
        assert r.status_code == 413


def _mul_scores(attn: torch.Tensor, ids: list[int]) -> dict[str, torch.Tensor]:
    """TransformerLens' "mul" scores written out with loops, in float64: for each head,
    sum(A * P) / sum(A) with P the 0/1 detection pattern of the page's three detectors; and a
    perfect head's score (the share of queries with a target)."""
    L = len(ids)
    targets = {  # (query i, key j) -> on the pattern
        "previous_token": lambda i, j: j == i - 1,
        "first_token": lambda i, j: j == 0,
        "induction": lambda i, j: 1 <= j <= i and any(
            ids[m] == ids[i] and m + 1 == j for m in range(i)),
    }
    N, H = attn.shape[:2]
    out, perfect = {}, {}
    for name, on in targets.items():
        P = torch.tensor([[float(on(i, j)) for j in range(L)] for i in range(L)],
                         dtype=torch.float64)
        out[name] = torch.tensor([[float((attn[n, h] * P).sum() / attn[n, h].sum())
                                   for h in range(H)] for n in range(N)], dtype=torch.float64)
        perfect[name] = round(sum(float(P[i].sum() > 0) for i in range(L)) / L, 4)
    return out, perfect


def test_detector_scores_are_detect_heads_on_the_probe(folders):
    """The page's numbers are ``detect_heads(model, probe, kind)``'s, and both are the "mul"
    score recomputed here from float64 attention weights."""
    from handformer.inspect import detect_heads

    lm, _ = folders
    state = ModelState(lm)
    got = head_scores(state)
    assert head_scores(state) is got  # computed once per model
    ids, offset = probe_ids(state)
    T = (len(ids) - offset) // 2
    assert ids[offset:offset + T] == ids[offset + T:]  # the probe repeats itself
    model = state.model.double()
    try:
        with torch.inference_mode():
            attn = torch.stack([a[0] for a in model(torch.tensor([ids]), need_weights=True)
                                .attentions])  # (N, H, L, L) float64
    finally:
        state.model.float()
    expected, perfect = _mul_scores(attn, ids)
    kinds = {"previous_token": "previous_token", "induction": "induction", "first_token": "bos"}
    for name, kind in kinds.items():
        page = torch.tensor(got[name], dtype=torch.float64)
        torch.testing.assert_close(page, expected[name], atol=2e-4, rtol=0, msg=name)
        direct = detect_heads(state.model, torch.tensor([ids]), kind, progress=False)
        torch.testing.assert_close(page, direct, atol=1e-4, rtol=0, msg=name)
    assert got["probe"]["perfect"] == perfect
    L = len(ids)
    assert perfect["previous_token"] == round((L - 1) / L, 4) and perfect["first_token"] == 1
    assert perfect["induction"] >= round(T / L, 4)  # the second copy, and any repeats in it


def test_detector_scores_find_planted_heads():
    # Hand-made patterns: head 0 previous-token, head 1 induction, head 2 first-token.
    offset, T = 1, 6
    ids = [0] + list(range(1, T + 1)) * 2
    L = offset + 2 * T
    attn = torch.zeros(1, 3, L, L)
    for i in range(L):
        attn[0, 0, i, max(i - 1, 0)] = 1
        attn[0, 2, i, 0] = 1
        attn[0, 1, i, i] = 1
    for k in range(T):
        q = offset + T + k
        attn[0, 1, q] = 0
        attn[0, 1, q, offset + k + 1] = 1
    s = scores_from_attention(attn, ids)
    # the "mul" score: query 0 has no previous token, the first copy no induction target
    assert s["previous_token"][0].argmax() == 0
    assert s["previous_token"][0, 0].item() == pytest.approx((L - 1) / L)
    assert s["induction"][0].argmax() == 1 and s["induction"][0, 1].item() == pytest.approx(T / L)
    assert s["first_token"][0].argmax() == 2 and s["first_token"][0, 2] == 1


def test_api_heads_endpoint(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        r = c.get("/api/heads").json()
        assert r["model"] == "lm" and len(r["induction"]) == 2 and len(r["induction"][0]) == 4
        enc = c.get("/api/heads", params={"model": "all-MiniLM-L6-v2"}).json()
        assert len(enc["previous_token"]) == 6 and len(enc["previous_token"][0]) == 12
        assert all(0 <= v <= 1 for row in enc["first_token"] for v in row)
        assert set(enc["probe"]["perfect"]) == {"previous_token", "induction", "first_token"}


class _ChatTokenizer:
    """A character tokenizer with a chat template, standing in for an instruct model's."""

    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"

    def __init__(self, inner):
        self.inner = inner
        self.seen = []

    def apply_chat_template(self, messages, *, add_generation_prompt=True):
        self.seen.append(messages)
        return "".join(f"{m['role'][0]}. {m['content']} " for m in messages) + "a."

    def encode(self, text, add_special_tokens=True):
        return self.inner.encode(text)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_chat_messages_are_rendered_by_the_template(folders):
    lm, _ = folders
    state = ModelState(lm)
    with pytest.raises(RequestError, match="has no chat template"):
        parse_generate({"messages": [{"role": "user", "content": "hi"}]}, state)
    state.tokenizer = _ChatTokenizer(state.tokenizer)
    assert state.info()["chat_template"] is True
    req = parse_generate({"messages": [{"role": "user", "content": "hi there"}]}, state)
    assert req.chat and req.text == "u. hi there a."
    for bad, match in (({"messages": [], "text": "x"}, "either text"),
                       ({"messages": []}, "list of 1..64"),
                       ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
                       ({"messages": [{"role": "user"}]}, "role")):
        with pytest.raises(RequestError, match=match):
            parse_generate(bad, state)
    from handformer.serve.generation import Generation

    gen = Generation(state, req)
    start = gen.start()
    assert start["chat"] is True and start["prompt"] == "u. hi there a."
    assert "".join(start["prompt_tokens"]).replace("\u2423", " ") == "u. hi there a."
    assert gen.step()["event"] == "token"



def test_large_context_models_are_served_within_the_view_budget(tmp_path):
    import handformer as hf
    from handformer.serve.state import VIEW_BUDGET, view_limit
    from handformer.train.data import CharVocab
    from serve_util import CHARS

    assert view_limit(30, 9) == 544 and view_limit(6, 12) == 1054  # SmolLM2, MiniLM shapes
    assert 30 * 9 * view_limit(30, 9) ** 2 <= VIEW_BUDGET
    vocab = CharVocab(CHARS)
    model = hf.CausalLM(hf.CausalLMConfig(vocab_size=len(vocab), max_len=4096, d_model=16,
                                          num_heads=16, num_layers=20, d_ff=32))
    model.save_pretrained(tmp_path)
    vocab.save(tmp_path / "vocab.json")
    state = ModelState(tmp_path)
    assert (state.context, state.max_tokens) == (4096, view_limit(20, 16)) == (4096, 500)
    r = compute.run(state, parse_run({"text": "the cat sat. " * 60}, state))
    assert len(r["tokens"]) == 500
    assert r["notices"] == ["text has 780 tokens, more than the limit of 500 tokens this page "
                            "shows for a model of 20 x 16 heads (its context is 4096); only "
                            "the first 500 were used"]
    assert state.info()["context"] == 4096
