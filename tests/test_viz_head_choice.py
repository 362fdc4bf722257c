"""``choose_head`` and ``summarize`` on planted attention (issue 33, items 1 and 2): the head
shown first is the strongest link's in whatever layer it lies, and the first position, the
attention sink, is left out of the links unless asked for."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from handformer.viz import summarize
from handformer.viz.head_choice import choose_head

N, H, L = 6, 12, 15
TOKENS = [f"w{i}" for i in range(L)]  # ordinary tokens, one word each


def uniform() -> list[np.ndarray]:
    """Six per-layer ``(1, H, L, L)`` arrays, every query spread evenly over every key (what
    ``viz`` passes: one ``(B, H, L, L)`` per layer)."""
    return [np.full((1, H, L, L), 1.0 / L, dtype=np.float32) for _ in range(N)]


def planted(layer: int, head: int, weight: float = 0.9, query: int = 10,
            key: int = 3) -> list[np.ndarray]:
    x = uniform()
    x[layer][0, head, query] = (1.0 - weight) / (L - 1)
    x[layer][0, head, query, key] = weight
    return x


@pytest.mark.parametrize("layer, head", [(4, 1), (5, 11), (2, 7), (0, 1)])
def test_a_strong_link_in_any_layer_is_chosen(layer, head):
    x = planted(layer, head)
    assert choose_head(x, TOKENS) == (layer, head)
    summary = summarize(x, TOKENS)
    assert summary[layer].link[:3] == (head, 10, 3)
    assert summary[layer].link[3] == pytest.approx(0.9)


@pytest.mark.parametrize("form", ["list", "tuple of (H, L, L) tensors", "model output",
                                  "list of (1, H, L, L) tensors"])
def test_every_form_of_per_layer_weights(form):
    x = planted(4, 1)
    given = {"list": x,
             "tuple of (H, L, L) tensors": tuple(torch.from_numpy(a[0]) for a in x),
             "model output": SimpleNamespace(attentions=[torch.from_numpy(a) for a in x]),
             "list of (1, H, L, L) tensors": [torch.from_numpy(a) for a in x]}[form]
    assert choose_head(given, TOKENS) == (4, 1)


def test_a_fixed_layer_or_head_is_kept():
    x = planted(4, 1)
    x[2][0, 5, 12, 2] = 0.6  # the strongest link of layer 2
    assert choose_head(x, TOKENS, layer=2) == (2, 5)
    assert choose_head(x, TOKENS, head=5) == (2, 5)
    assert choose_head(x, TOKENS, layer=3, head=4) == (3, 4)


def test_the_fallback_looks_at_every_layer():
    """Only special tokens: no ordinary link, so the strongest weight between two different
    positions (not to the first key) decides, in whichever layer it lies."""
    x = planted(5, 3, weight=0.8, query=7, key=2)
    assert choose_head(x, ["[UNK]"] * L) == (5, 3)
    assert choose_head(x, TOKENS, special=[True] * L) == (5, 3)


def sink_heavy() -> list[np.ndarray]:
    """Position 0 takes 0.9 of every query in every head (an attention sink, strongest in
    layer 1, head 5: 0.97), and one weaker link, w8 -> w4 0.3, in layer 3, head 2."""
    x = []
    for _ in range(N):
        a = np.full((1, H, L, L), 0.1 / (L - 1), dtype=np.float32)
        a[..., 0] = 0.9
        x.append(a)
    x[1][0, 5, :, 1:] = 0.03 / (L - 1)
    x[1][0, 5, :, 0] = 0.97
    x[3][0, 2, 8, 1:] = 0.6 / (L - 2)
    x[3][0, 2, 8, 4] = 0.3
    return x


def test_the_first_position_is_left_out_as_an_attention_sink():
    x = sink_heavy()
    assert choose_head(x, TOKENS) == (3, 2)
    summary = summarize(x, TOKENS, min_distance=2)
    assert all(s.link is None or s.link[2] != 0 for s in summary)
    assert summary[3].link[1:3] == (8, 4)
    assert summary[1].top_key == 0  # "most attention" still says where the weight goes


def test_include_sink_counts_it():
    x = sink_heavy()
    assert choose_head(x, TOKENS, include_sink=True) == (1, 5)
    summary = summarize(x, TOKENS, include_sink=True)
    assert summary[1].link[0] == 5 and summary[1].link[2] == 0
    assert summary[1].link[3] == pytest.approx(0.97)


def test_one_token_has_no_link_and_no_crash():
    x = [np.ones((1, 3, 1, 1), dtype=np.float32) for _ in range(2)]
    assert [s.link for s in summarize(x, ["a"])] == [None, None]
    assert choose_head(x, ["a"]) == (0, 0)
    assert choose_head(x, ["a"], include_sink=True) == (0, 0)
