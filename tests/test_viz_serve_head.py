"""The page ``handformer serve`` builds opens on the head ``handformer viz`` chooses: the
strongest link over every layer, the attention sink left out unless the request asks
(issue 33, items 1 and 2)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

from handformer.serve import compute
from handformer.serve.page import build_page
from handformer.serve.state import ModelState
from handformer.serve.validation import parse_run
from handformer.viz import summarize

SEED = "The animal didn't cross the street because it was too tired"


@pytest.fixture(scope="module")
def minilm():
    return ModelState(None)


def test_the_page_opens_on_the_strongest_link_of_every_layer(minilm):
    page, _ = build_page(minilm, SEED)
    m = re.search(r'<script type="application/json" id="hf-data">(.*?)</script>', page, re.S)
    data = json.loads(m.group(1).replace("\\/", "/"))
    # the strongest link between words two or more apart, from the model run here
    enc = compute.encode(minilm, SEED)
    with torch.inference_mode():
        out = minilm.model(**enc.batch, need_weights=True)
    words = [0, 1, 2, 3, 3, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]  # [CLS] the animal didn ' t ...
    best = max((s for s in summarize(list(out.attentions), enc.tokens, words=words,
                                     min_distance=2) if s.link is not None),
               key=lambda s: s.link[3])
    assert (data["layer"], data["head"]) == (best.layer, best.link[0])
    assert data["layer"] != 0  # on this sentence the strongest link lies deeper
    assert data["include_sink"] is False


def _sink_heavy(N: int = 4, H: int = 6, L: int = 9) -> list[torch.Tensor]:
    """Key 0 takes 0.9 of every query, 0.97 in layer 1, head 5; one weaker link, query 7 ->
    key 3 0.3, in layer 3, head 2."""
    x = []
    for _ in range(N):
        a = torch.full((1, H, L, L), 0.1 / (L - 1))
        a[..., 0] = 0.9
        x.append(a)
    x[1][0, 5, :, 1:] = 0.03 / (L - 1)
    x[1][0, 5, :, 0] = 0.97
    x[3][0, 2, 7, 1:] = 0.6 / (L - 2)
    x[3][0, 2, 7, 3] = 0.3
    return x


def test_first_head_leaves_the_sink_out_unless_asked():
    enc = SimpleNamespace(tokens=[f"w{i}" for i in range(9)], special=[False] * 9,
                          unknown=[False] * 9)
    assert compute.first_head(_sink_heavy(), enc) == (3, 2)
    assert compute.first_head(_sink_heavy(), enc, include_sink=True) == (1, 5)


def test_the_api_takes_include_sink(minilm):
    plain = parse_run({"text": SEED, "choose_head": True}, minilm)
    sink = parse_run({"text": SEED, "choose_head": True, "include_sink": True}, minilm)
    assert (plain.include_sink, sink.include_sink) == (False, True)
    assert compute.run(minilm, sink)["viewer"]["include_sink"] is True
    assert compute.run(minilm, plain)["viewer"]["include_sink"] is False
