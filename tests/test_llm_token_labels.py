"""One labelling of tokens everywhere, on SmolLM2 reading Chinese: the page's next-token list
(``/api/run``, ``/api/ablate``), the attribution view, ``viz --attribution``'s line and
``test_prompt`` label a candidate that is part of a character as the prompt's tokens are
labelled (``"byte 1/3 of a character (E9)"``), never a raw ``<0xE9>`` or U+FFFD.

SmolLM2's byte-level BPE splits most Chinese characters, and after a Chinese prompt its most
likely next tokens are lead bytes: the reference for "is this a piece of a character" is the
candidate's own bytes (decoded alone it is U+FFFD).
"""

from __future__ import annotations

import io
import json
import re

import pytest
import torch

from handformer.serve import compute
from handformer.serve.attribution import attribution
from handformer.serve.state import ModelState
from handformer.serve.validation import parse_run

PROMPT = "我喜欢吃"  # "I like to eat": the top next tokens start a character
RAW = re.compile(r"<0x[0-9A-Fa-f]{2}>|\ufffd")


@pytest.fixture(scope="module")
def state(smollm2) -> ModelState:  # noqa: ANN001
    """The page's model state around the session's SmolLM2 (not loaded a second time)."""
    import handformer.serve.state as state_module

    real = state_module._load_causal
    state_module._load_causal = lambda source, device, quantize=None: smollm2
    try:
        return ModelState("smollm2-135m-instruct")
    finally:
        state_module._load_causal = real


def pieces(state: ModelState, candidates: list[dict]) -> list[dict]:
    """The candidates that are parts of a character (decoded alone: U+FFFD)."""
    return [c for c in candidates if "\ufffd" in state.tokenizer.decode([c["id"]])]


def test_served_next_token_list_has_no_raw_bytes(state: ModelState) -> None:
    r = compute.run(state, parse_run({"text": PROMPT}, state))
    listed = r["next_token"]
    assert len(pieces(state, listed)) >= 2  # the test needs byte candidates
    assert not RAW.search(json.dumps(listed, ensure_ascii=False))
    for c in pieces(state, listed):
        assert re.fullmatch(r"bytes? 1(-\d)?/[234] of a character \([0-9A-F ]+\)", c["token"])
    assert len({c["token"] for c in listed}) == len(listed)  # told apart by their bytes
    # the prompt's own tokens: the same scheme (动·1/3-style), never raw either
    assert not RAW.search(json.dumps(r["tokens"], ensure_ascii=False))


def test_ablation_and_attribution_label_the_same_way(state: ModelState) -> None:
    req = parse_run({"text": PROMPT, "heads": [[0, 0]]}, state)
    r = compute.ablate(state, req)
    assert not RAW.search(json.dumps([r["clean"], r["ablated"]], ensure_ascii=False))
    first = compute.run(state, parse_run({"text": PROMPT}, state))["next_token"][0]
    assert r["clean"][0]["token"] == first["token"]
    a = attribution(state, parse_run({"text": PROMPT}, state))
    assert a["token"] == {"id": first["id"], "token": first["token"]}


def test_cli_attribution_line_and_test_prompt(smollm2, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    import handformer.commands.generate as generate
    from handformer.commands.viz_attribution import draw_attribution
    from handformer.inspect import test_prompt

    monkeypatch.setattr(generate, "load_model_and_tokenizer", lambda source: smollm2)
    _, line = draw_attribution("smollm2-135m-instruct", PROMPT, tmp_path, device="cpu",
                               name="smollm2")
    assert "of a character (" in line and not RAW.search(line)
    model, tok = smollm2
    out = io.StringIO()
    with torch.no_grad():
        ranks = test_prompt(model, tok, PROMPT, "饭", prepend_space=False, top_k=5, file=out)
    assert not RAW.search(out.getvalue()) and "of a character (" in out.getvalue()
    assert all(not RAW.search(text) for r in ranks for text, _, _ in r.top)
