"""The page's Features view API (``handformer serve --dictionary PATH``): a tiny causal LM and a
tiny sparse autoencoder the test writes, each answer checked against an independent path
(the core's ``attach`` splice with a zeroed feature, the float64 unembedding, the dictionary's
own ``encode`` on a cached activation)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from handformer.features import SparseAutoencoder, attach, save_dictionary  # noqa: E402
from handformer.inspect import hooks, run_with_cache  # noqa: E402
from handformer.serve import ModelState, create_app  # noqa: E402
from handformer.serve.features import load_feature_set  # noqa: E402
from serve_util import ROOT, causal_folder  # noqa: E402

HOOK = "blocks.1.hook_resid_post"
TEXT = "the cat sat on the mat"


def tiny_sae(d_in: int, *, seed: int = 1, hook: str = HOOK) -> SparseAutoencoder:
    torch.manual_seed(seed)
    sae = SparseAutoencoder(d_in, 48, activation="relu", hook_name=hook)
    with torch.no_grad():
        sae.W_enc.normal_(0, 0.5)
        sae.b_enc.fill_(-0.2)
        sae.W_dec.normal_(0, 0.3)
        sae.b_dec.normal_(0, 0.1)
    return sae


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("feat")
    folder = causal_folder(root / "model")
    state = ModelState(str(folder))
    sae = tiny_sae(32)
    save_dictionary(sae, root / "sae_a")
    features = load_feature_set([str(root / "sae_a")], state)
    with TestClient(create_app(state, features=features)) as client:
        yield client, state, features.dictionaries["sae_a"], root


def ids_of(state, text):
    return torch.tensor([state.tokenizer.encode(text)])


def test_listing_names_the_dictionary(setup):
    client, state, sae, _ = setup
    body = client.get("/api/features").json()
    assert body["model"] == state.name
    assert body["dictionaries"] == [{"name": "sae_a", "hook": HOOK, "d_in": 32, "d_sae": 48,
                                     "activation": "relu", "k": None}]


def test_active_features_are_the_encoded_activation(setup):
    client, state, sae, _ = setup
    r = client.post("/api/features/active", json={"text": TEXT, "top": 5}).json()
    ids = ids_of(state, TEXT)
    _, cache = run_with_cache(state.model, ids, names=HOOK)
    acts = sae.encode(cache[HOOK])[0].double()  # (L, F)
    assert len(r["active"]) == ids.shape[1] == len(r["tokens"])
    assert r["l0"] == (acts > 0).sum(-1).tolist()
    for pos, listed in enumerate(r["active"]):
        want = acts[pos].topk(5)
        want = [(int(f), float(v)) for f, v in zip(want.indices, want.values, strict=True)
                if v > 0]
        assert [x["feature"] for x in listed] == [f for f, _ in want]
        assert [x["value"] for x in listed] == pytest.approx([v for _, v in want], abs=1e-4)
    assert any(listed for listed in r["active"])  # the test's SAE is active somewhere


def test_ablation_equals_the_spliced_dictionary_with_the_feature_zeroed(setup):
    client, state, sae, _ = setup
    ids = ids_of(state, TEXT)
    _, cache = run_with_cache(state.model, ids, names=HOOK)
    f = int(sae.encode(cache[HOOK])[0, -1].argmax())  # active at the last token
    r = client.post("/api/features/intervene",
                    json={"text": TEXT, "feature": f, "mode": "ablate", "new_tokens": 3}).json()

    def zero(t, name):
        t = t.clone()
        t[..., f] = 0
        return t
    with torch.no_grad(), attach(state.model, sae, at=HOOK):
        with hooks(state.model, {f"{HOOK}.hook_sae_acts_post": zero}):
            logits = state.model(ids).logits[0, -1].double()
    probs = torch.softmax(logits, -1)
    for cand in r["changed"]:
        assert cand["prob"] == pytest.approx(float(probs[cand["id"]]), abs=1e-5)
    assert r["changed"][0]["id"] == int(probs.argmax())
    assert r["kl_divergence"] > 1e-6  # zeroing an active feature changes the prediction
    with torch.no_grad():
        clean = torch.softmax(state.model(ids).logits[0, -1].double(), -1)
    assert r["clean"][0]["prob"] == pytest.approx(float(clean.max()), abs=1e-5)


def test_steering_with_a_large_coefficient_emits_the_aligned_token(setup):
    client, state, sae, _ = setup
    target = state.tokenizer.encode("z")[0]
    W_U = state.model.lm_head.weight.detach()  # (V, E)
    saved = sae.W_dec[7].clone()
    try:
        with torch.no_grad():
            sae.W_dec[7] = W_U[target] / W_U[target].norm()
        r = client.post("/api/features/intervene", json={
            "text": TEXT, "feature": 7, "mode": "steer", "coefficient": 200,
            "new_tokens": 4}).json()
    finally:
        with torch.no_grad():
            sae.W_dec[7] = saved
    assert r["changed"][0]["id"] == target and r["clean"][0]["id"] != target
    assert r["changed_text"] == "zzzz" and r["clean_text"] != "zzzz"


def test_card_contexts_and_logit_effects(setup):
    client, state, sae, _ = setup
    ids = ids_of(state, TEXT)
    _, cache = run_with_cache(state.model, ids, names=HOOK)
    acts = sae.encode(cache[HOOK])[0]  # (L, F)
    f = int(acts[1:].max(0).values.argmax())
    client.post("/api/features/active", json={"text": TEXT})  # remembered for the card
    card = client.post("/api/features/card", json={"feature": f}).json()
    assert card["texts_seen"] >= 1 and card["contexts"]
    values = [c["activation"] for c in card["contexts"]]
    assert values == sorted(values, reverse=True)
    seen = [c for c in card["contexts"] if c["source"] == "seen"]
    assert seen and max(c["activation"] for c in seen) == pytest.approx(
        float(acts[1:, f].max()), abs=1e-4)
    # Logit effects: W_U (V, E) · (final-norm weight ⊙ W_dec[f]), in float64; this model's
    # final norm is a LayerNorm, which centres what it reads.
    assert isinstance(state.model.ln_final, torch.nn.LayerNorm)
    row = sae.W_dec[f].detach().double()
    direction = (row - row.mean()) * state.model.ln_final.weight.detach().double()
    effects = state.model.lm_head.weight.detach().double() @ direction  # (V,)
    top = [state.tokenizer.decode([int(i)]) for i in effects.topk(3).indices]
    assert [p["token"] for p in card["promoted"][:3]] == top
    assert card["promoted"][0]["value"] == pytest.approx(float(effects.max()), rel=1e-4)
    assert card["suppressed"][0]["value"] == pytest.approx(float(effects.min()), rel=1e-4)


@pytest.mark.parametrize("payload,field", [
    ({"text": TEXT, "feature": 48}, "feature"),
    ({"text": TEXT, "feature": -1}, "feature"),
    ({"text": TEXT, "feature": True}, "feature"),
    ({"text": TEXT}, "feature"),
    ({"text": TEXT, "feature": 1, "mode": "boost"}, "mode"),
    ({"text": TEXT, "feature": 1, "mode": "steer"}, "coefficient"),
    ({"text": TEXT, "feature": 1, "mode": "steer", "coefficient": 1e9}, "coefficient"),
    ({"text": TEXT, "feature": 1, "mode": "steer", "coefficient": "2"}, "coefficient"),
    ({"text": TEXT, "feature": 1, "coefficient": 3}, "coefficient"),
    ({"text": TEXT, "feature": 1, "new_tokens": 99}, "new_tokens"),
    ({"text": TEXT, "feature": 1, "dictionary": "other"}, "dictionary"),
    ({"text": TEXT, "feature": 1, "model": "other"}, "model"),
    ({"text": TEXT, "feature": 1, "heads": []}, "heads"),
    ({"feature": 1}, "text"),
    ({"text": TEXT, "ids": [1], "feature": 1}, "ids"),
])
def test_bad_fields_are_one_line_422s(setup, payload, field):
    client = setup[0]
    r = client.post("/api/features/intervene", json=payload)
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["field"] == field and "\n" not in body["error"]


def test_nan_coefficient_and_bad_top(setup):
    client = setup[0]
    r = client.post("/api/features/intervene", content=b'{"text": "ab", "feature": 1, '
                    b'"mode": "steer", "coefficient": NaN}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["field"] == "coefficient"
    r = client.post("/api/features/active", json={"text": "ab", "top": 0})
    assert r.status_code == 422 and r.json()["field"] == "top"
    r = client.post("/api/features/card", json={"feature": 1, "text": "ab"})
    assert r.status_code == 422 and r.json()["field"] == "text"


def test_without_dictionaries_the_view_is_off(setup):
    _, state, _, _ = setup
    with TestClient(create_app(state)) as client:
        assert client.get("/api/features").json()["dictionaries"] == []
        r = client.post("/api/features/active", json={"text": "ab"})
        assert r.status_code == 404 and "--dictionary" in r.json()["error"]


def test_a_dictionary_of_another_width_is_refused_at_start(setup, tmp_path):
    _, state, _, root = setup
    save_dictionary(tiny_sae(16), tmp_path / "narrow")
    with pytest.raises(ValueError, match=r"d_in = 16 .* width 32"):
        load_feature_set([str(tmp_path / "narrow")], state)
    save_dictionary(tiny_sae(32, hook="blocks.9.hook_resid_post"), tmp_path / "deep")
    with pytest.raises(ValueError, match="no hook point 'blocks.9.hook_resid_post'"):
        load_feature_set([str(tmp_path / "deep")], state)
    # The command line: one line on stderr, exit 2, before serving.
    out = subprocess.run([sys.executable, "-m", "handformer", "serve", "--port", "0",
                          "--model", str(root / "model"), "--sae", str(tmp_path / "narrow")],
                         capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip()
    assert "\n" not in line and "--dictionary" in line and "d_in = 16" in line
    assert json.dumps(line)  # printable
