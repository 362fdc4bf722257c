"""Issue 24, items 10-11: one rule for the command line and the JSON API.

* An option of one attention kind given with another (``window_size`` without ``local``,
  ``global_tokens`` or ``stride`` without ``strided``) was refused by the CLI and silently
  ignored by the API: now both refuse it (the API with 422 naming the field).
* ``--seed -1`` was accepted by the CLI and refused by the API; ``--temperature inf`` was
  accepted by the CLI: now one rule (:func:`handformer.models.generation.check_sampling`,
  with :func:`handformer.checks.check_seed`) decides for both, and the table below runs every
  value through both and checks that they agree.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from handformer.cli import main
from handformer.serve import ModelState, create_app
from handformer.serve.validation import RequestError, parse_generate, parse_run
from pretrained_util import tiny_checkpoint
from serve_util import causal_folder

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bert")
    tiny_checkpoint(folder, hidden_size=16, layers=2, heads=2, intermediate=16)
    return folder


@pytest.fixture(scope="module")
def bert_state(bert_folder: Path) -> ModelState:
    return ModelState(bert_folder)


@pytest.fixture(scope="module")
def lm_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return causal_folder(tmp_path_factory.mktemp("lm"))


@pytest.fixture(scope="module")
def lm_state(lm_folder: Path) -> ModelState:
    return ModelState(lm_folder)


@pytest.fixture(scope="module")
def client(bert_state: ModelState):
    with TestClient(create_app(bert_state)) as c:
        yield c


def cli_code(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str]:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    _, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, err


# ---- 10: options of another attention kind ----------------------------------------------------


@pytest.mark.parametrize("body, field, words", [
    ({"window_size": 7}, "window_size", 'applies to attention "local", not "full"'),
    ({"attention": "strided", "window_size": 7}, "window_size",
     'applies to attention "local", not "strided"'),
    ({"global_tokens": 2}, "global_tokens", 'applies to attention "strided", not "full"'),
    ({"attention": "local", "stride": 2}, "stride", 'applies to attention "strided", not '
                                                    '"local"'),
    ({"attention": "linear", "global_tokens": 0}, "global_tokens", "not \"linear\""),
])
def test_api_refuses_an_option_of_another_kind_with_422(client, body, field, words) -> None:
    r = client.post("/api/run", json={"text": "the cat sat", **body})
    assert r.status_code == 422, r.text
    answer = r.json()
    assert answer["field"] == field
    assert words in answer["error"]
    assert "send \"attention\": " in answer["error"] and f"leave {field} out" in answer["error"]


@pytest.mark.parametrize("flags, flag, kind", [
    (["--window-size", "7"], "--window-size", "local"),
    (["--attention", "strided", "--window-size", "7"], "--window-size", "local"),
    (["--global-tokens", "2"], "--global-tokens", "strided"),
    (["--attention", "local", "--stride", "2"], "--stride", "strided"),
])
def test_cli_refuses_the_same_combinations(flags, flag, kind, bert_folder, tmp_path,
                                           capsys) -> None:
    code, err = cli_code(capsys, "viz", "the cat sat", "--model", bert_folder, *flags,
                         "--out", tmp_path / "v")
    assert code == 2
    assert f"{flag} " in err and f"applies to --attention {kind}" in err


def test_api_accepts_the_options_with_their_kind(client) -> None:
    for body in ({"attention": "local", "window_size": 3},
                 {"attention": "strided", "stride": 2, "global_tokens": 0},
                 {"attention": "local"}, {}):
        r = client.post("/api/run", json={"text": "the cat sat", **body})
        assert r.status_code == 200, (body, r.text)


def test_api_option_of_the_models_default_kind_needs_no_attention_field(lm_folder,
                                                                         tmp_path) -> None:
    """A local-attention model's default kind is local: window_size alone is its option."""
    state = ModelState(causal_folder(tmp_path / "local", attention="local", window_size=7))
    assert parse_run({"text": "ab", "window_size": 3}, state).attention.window_size == 3
    with pytest.raises(RequestError) as info:
        parse_run({"text": "ab", "stride": 3}, state)
    assert info.value.field == "stride"


def test_api_accepts_a_real_models_window(client) -> None:
    """Windows of real configurations pass (the old 4096 cap refused 8191, Mistral's)."""
    r = client.post("/api/run", json={"text": "the cat", "attention": "local",
                                      "window_size": 262143})
    assert r.status_code == 200, r.text
    r = client.post("/api/run", json={"text": "the cat", "attention": "local",
                                      "window_size": 2**31 + 1})
    assert r.status_code == 422 and r.json()["field"] == "window_size"
    assert "at most 2147483647" in r.json()["error"]


# ---- 11: seeds and temperatures ------------------------------------------------------------

# (option, value): what both interfaces must say about it.
CASES = [
    ("seed", -1, False), ("seed", 0, True), ("seed", 2**63 - 1, True), ("seed", 2**63, False),
    ("temperature", float("inf"), False), ("temperature", float("-inf"), False),
    ("temperature", float("nan"), False), ("temperature", 0.0, False),
    ("temperature", -0.5, False), ("temperature", 0.7, True), ("temperature", 1000.0, True),
    ("top_k", 0, False), ("top_k", 5, True), ("top_k", 2**31, False),
    ("top_p", 0.0, False), ("top_p", 1.0, True), ("top_p", 1.5, False),
    ("top_p", float("nan"), False),
]


def _api_accepts(state: ModelState, name: str, value: object) -> tuple[bool, str | None]:
    body = json.loads(json.dumps({"text": "ab", "max_new_tokens": 1, name: value}))
    try:
        parse_generate(body, state)
    except RequestError as exc:
        return False, exc.field
    return True, None


@pytest.mark.parametrize("name, value, ok", CASES, ids=[f"{n}={v}" for n, v, _ in CASES])
def test_cli_and_api_agree(name, value, ok, lm_state, lm_folder, capsys) -> None:
    api_ok, field = _api_accepts(lm_state, name, value)
    flag = "--" + name.replace("_", "-")
    code, err = cli_code(capsys, "generate", "--model", lm_folder, "--prompt", "ab",
                         "--max-new-tokens", "1", f"{flag}={value}")  # -inf is no flag
    assert api_ok == ok, (name, value, field)
    assert (code == 0) == ok, err
    if not ok:
        assert field == name
        assert err.startswith(f"handformer generate: error: {flag} "), err
        assert err.count("\n") == 1


def test_the_user_cases(lm_state, lm_folder, capsys) -> None:
    """`--seed -1` and `--temperature inf` on the command line; seed -1 and Infinity in JSON."""
    code, err = cli_code(capsys, "generate", "--model", lm_folder, "--prompt", "ab",
                         "--seed", "-1")
    assert code == 2 and "--seed must be an integer in 0..2**63 - 1, got -1" in err
    code, err = cli_code(capsys, "generate", "--model", lm_folder, "--prompt", "ab",
                         "--temperature", "inf")
    assert code == 2 and "--temperature must be a finite number > 0, got inf" in err
    with pytest.raises(RequestError, match=r"^seed: must be an integer in 0..2\*\*63 - 1, "
                                           r"got -1$"):
        parse_generate({"text": "ab", "seed": -1}, lm_state)
    body = json.loads('{"text": "ab", "temperature": Infinity}')  # Python's json reads it
    with pytest.raises(RequestError, match=r"^temperature: must be a finite number > 0, "
                                           r"got inf$"):
        parse_generate(body, lm_state)


def test_library_generate_refuses_non_finite_temperatures() -> None:
    import torch

    import handformer as hf

    lm = hf.CausalLM(hf.CausalLMConfig(vocab_size=7, max_len=8, d_model=8, num_heads=2,
                                       num_layers=1, d_ff=8))
    ids = torch.randint(7, (1, 2))
    for t in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match="^temperature must be"):
            lm.generate(ids, max_new_tokens=1, do_sample=True, temperature=t)
    with pytest.raises(ValueError, match="^temperature must be a finite number, got inf"):
        lm.generate(ids, max_new_tokens=1, temperature=float("inf"))  # greedy: still refused


def test_train_and_demo_seeds_follow_the_same_rule(tmp_path, capsys) -> None:
    from handformer.train import TrainConfig

    with pytest.raises(ValueError, match=r"^seed must be an integer in 0..2\*\*63 - 1"):
        TrainConfig(task="copy", seed=-1).validate()
    with pytest.raises(ValueError, match=r"^seed must be an integer in 0..2\*\*63 - 1"):
        TrainConfig(task="copy", seed=2**63).validate()
    TrainConfig(task="copy", seed=2**63 - 1).validate()
    code, err = cli_code(capsys, "demo", "--seed", "-1")
    assert code == 2 and "--seed must be an integer in 0..2**63 - 1, got -1" in err
