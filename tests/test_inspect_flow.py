"""Attention flow: a graph checked by hand, and networkx's Edmonds-Karp on the paper's graph."""

from __future__ import annotations

import sys

import networkx as nx
import numpy as np
import pytest
import torch

from handformer.inspect import attention_flow, attention_rollout, residual_attention

# The hand-checkable case: 3 tokens, 2 layers, 1 head.
A1 = torch.tensor([[1.0, 0.0, 0.0],
                   [1.0, 0.0, 0.0],
                   [0.0, 1.0, 0.0]], dtype=torch.float64)
A2 = torch.tensor([[0.0, 0.5, 0.5],
                   [0.5, 0.0, 0.5],
                   [0.0, 0.0, 1.0]], dtype=torch.float64)
# With the residual, Â = 0.5 A + 0.5 I (rows already sum to 1):
#   Â1 = [[1, 0, 0], [.5, .5, 0], [0, .5, .5]]      (layer-1 edges (1, k) -> (0, j))
#   Â2 = [[.5, .25, .25], [.25, .5, .25], [0, 0, 1]]  (layer-2 edges (2, i) -> (1, k))
# From (2, i) to (0, j) every path is (2, i) -> (1, k) -> (0, j), and different k use
# different edges, so the max flow is sum_k min(Â2[i, k], Â1[k, j]):
#   row 0: j=0: min(.5, 1) + min(.25, .5) + min(.25, 0)  = .5 + .25 + 0  = 0.75
#          j=1: min(.5, 0) + min(.25, .5) + min(.25, .5) = 0 + .25 + .25 = 0.5
#          j=2: min(.5, 0) + min(.25, 0)  + min(.25, .5) = 0 + 0 + .25   = 0.25
#   row 1: j=0: min(.25, 1) + min(.5, .5) + min(.25, 0)  = .25 + .5 + 0  = 0.75
#          j=1: min(.25, 0) + min(.5, .5) + min(.25, .5) = 0 + .5 + .25  = 0.75
#          j=2: min(.25, 0) + min(.5, 0)  + min(.25, .5) = 0 + 0 + .25   = 0.25
#   row 2: Â2[2] = [0, 0, 1], the single edge to (1, 2): Â1[2] = [0, .5, .5]
# Rollout multiplies instead: row 0 = .5 Â1[0] + .25 Â1[1] + .25 Â1[2] = [.625, .25, .125].
HAND_FLOW = [[0.75, 0.5, 0.25], [0.75, 0.75, 0.25], [0.0, 0.5, 0.5]]


def hand_attentions() -> list[torch.Tensor]:
    return [A1[None, None], A2[None, None]]  # (B=1, H=1, 3, 3) per layer


def test_flow_on_the_hand_checked_graph() -> None:
    got = attention_flow(hand_attentions(), rows="all")
    assert got.shape == (1, 3, 3) and got.dtype == torch.float64
    torch.testing.assert_close(got[0], torch.tensor(HAND_FLOW, dtype=torch.float64),
                               rtol=0, atol=0)
    torch.testing.assert_close(attention_rollout(hand_attentions())[0, 0],
                               torch.tensor([0.625, 0.25, 0.125], dtype=torch.float64))
    # Default: the first row ([CLS]) only; negative rows count from the end.
    torch.testing.assert_close(attention_flow(hand_attentions())[0, 0],
                               torch.tensor(HAND_FLOW[0], dtype=torch.float64))
    torch.testing.assert_close(attention_flow(hand_attentions(), rows=[-1, 1])[0],
                               torch.tensor([HAND_FLOW[2], HAND_FLOW[1]], dtype=torch.float64))
    normed = attention_flow(hand_attentions(), rows=0, normalize=True)[0, 0]
    torch.testing.assert_close(normed, torch.tensor([0.5, 1 / 3, 1 / 6], dtype=torch.float64))


def paper_flow(attentions: list[torch.Tensor]) -> np.ndarray:
    """The paper's construction, independently: one adjacency matrix over (N+1) x L nodes,
    node n * L + i, float capacities, networkx's Edmonds-Karp for every (output, input)."""
    mats = [a[0].double().mean(0).numpy() for a in attentions]
    N, L = len(mats), mats[0].shape[0]
    adj = np.zeros(((N + 1) * L, (N + 1) * L))
    for n, A in enumerate(mats, start=1):
        Ahat = 0.5 * A + 0.5 * np.eye(L)
        Ahat /= Ahat.sum(axis=1, keepdims=True)
        adj[n * L:(n + 1) * L, (n - 1) * L:n * L] = Ahat
    G = nx.DiGraph()
    for u, v in zip(*np.nonzero(adj), strict=True):
        G.add_edge(int(u), int(v), capacity=float(adj[u, v]))
    out = np.zeros((L, L))
    for i in range(L):
        for j in range(L):
            out[i, j] = nx.maximum_flow_value(G, N * L + i, j,
                                              flow_func=nx.algorithms.flow.edmonds_karp)
    return out


@pytest.mark.parametrize("layers, causal", [(3, False), (5, False), (4, True)])
def test_flow_equals_edmonds_karp_on_the_paper_graph(layers: int, causal: bool) -> None:
    scores = torch.randn(layers, 1, 3, 5, 5)
    if causal:  # a causal LM's pattern: keys after the query get nothing
        scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    att = list(scores.softmax(-1))
    got = attention_flow(att, rows="all")
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got[0].double().numpy(), paper_flow(att), atol=1e-6)
    # Another networkx algorithm on the same reused residual network: the same values.
    other = attention_flow(att, rows="all", flow_func=nx.algorithms.flow.preflow_push)
    torch.testing.assert_close(other, got, rtol=0, atol=0)
    # Upper bounds: what leaves the source (1) and what enters the sink (a column sum).
    into_sink = residual_attention(att)[0, 0].sum(dim=0)  # (L,)
    assert torch.all(got[0] <= torch.minimum(into_sink, torch.ones(5)).float() + 1e-6)


def test_one_layer_flow_is_the_residual_attention() -> None:
    att = [torch.randn(2, 4, 6, 6, dtype=torch.float64).softmax(-1)]
    torch.testing.assert_close(attention_flow(att, rows="all"), residual_attention(att)[0],
                               atol=6 / 2**30, rtol=0)


def test_padding_is_left_out() -> None:
    att = [torch.randn(1, 2, 4, 4, dtype=torch.float64).softmax(-1) for _ in range(2)]
    padded = []
    for a in att:  # the same 4 tokens plus 2 padding positions no real query attends to
        p = torch.zeros(2, 2, 6, 6, dtype=torch.float64)
        p[0, :, :4, :4] = a[0]
        p[0, :, 4:, :4] = 0.25  # padding queries look somewhere; they must not matter
        p[1] = torch.eye(6)
        padded.append(p)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6])
    got = attention_flow(padded, rows="all", attention_mask=mask, max_tokens=6)
    torch.testing.assert_close(got[0, :4, :4], attention_flow(att, rows="all")[0])
    assert torch.all(got[0, 4:] == 0) and torch.all(got[0, :, 4:] == 0)
    torch.testing.assert_close(got[1], torch.eye(6, dtype=torch.float64))


def test_progress_bar_counts_every_max_flow(capsys: pytest.CaptureFixture) -> None:
    att = [torch.rand(1, 2, 5, 5).softmax(-1)] * 3
    attention_flow(att, rows=[0, 2], progress=True)
    assert "10/10" in capsys.readouterr().err  # 2 rows x 5 tokens
    mask = torch.tensor([[1, 1, 1, 0, 0]])
    attention_flow(att, rows="all", attention_mask=mask, progress=True)
    assert "9/9" in capsys.readouterr().err  # 3 real rows x 3 real tokens


def test_flow_bad_input(monkeypatch: pytest.MonkeyPatch) -> None:
    att = [torch.rand(1, 2, 5, 5).softmax(-1)] * 2
    with pytest.raises(ValueError, match=r"the input has 5 tokens, over the limit "
                                         r"max_tokens=4 .*pass max_tokens=5"):
        attention_flow(att, max_tokens=4)
    with pytest.raises(ValueError, match=r"row 5 is out of range: the input has 5 positions, "
                                         r"valid rows are 0\.\.4"):
        attention_flow(att, rows=[5])
    with pytest.raises(ValueError, match=r"layer 2 is out of range.*valid layers are 0\.\.1"):
        attention_flow(att, layers=[2])
    with pytest.raises(ValueError, match="rows must be an index"):
        attention_flow(att, rows="cls")
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        attention_flow(att, max_tokens=0)
    monkeypatch.setitem(sys.modules, "networkx", None)  # as if the extra were not installed
    with pytest.raises(ImportError, match=r"pip install handformer\[inspect\]"):
        attention_flow(att)
