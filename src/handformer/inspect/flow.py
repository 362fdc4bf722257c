"""Attention flow (Abnar & Zuidema 2020): max-flow through the layer graph.

The graph has one node per (layer boundary, position): ``(0, j)`` is input token ``j``,
``(n, i)`` position ``i`` after the ``n``-th chosen layer. An edge runs from ``(n, i)`` to
``(n - 1, j)`` with capacity ``Â_n[i, j]``, the residual-augmented attention of
:func:`handformer.inspect.rollout.residual_attention`. The flow from output position ``i`` to
input token ``j`` is the maximum flow from ``(N, i)`` to ``(0, j)``: one max-flow problem per
(output, input) pair, as the paper defines it. Rollout multiplies the weights along every path;
flow asks how much can get through the narrowest cut, so it never double-counts a bottleneck.

The max-flow is networkx's (the optional extra: ``pip install handformer[inspect]``), not a
hand-written one. What makes it affordable, without changing any value:

* only the rows asked for are computed (default the ``[CLS]`` row, ``rows=0``): ``L`` problems
  instead of ``L²``;
* the graph and its residual network are built once per input and reused by every problem,
  and the source's and sink's layers are reduced to their own edges (see
  :class:`_LayerGraph`; half the time on the bundled model);
* capacities are integers (multiples of ``2**-30``), so networkx runs in exact integer
  arithmetic (its docs warn that float capacities can loop or go wrong); zero edges are left
  out (causal masks and padding drop whole triangles);
* the algorithm is ``shortest_augmenting_path``, the fastest of networkx's on these dense
  layered graphs (measured on the bundled model: 2x faster than preflow-push, 3x
  Boykov-Kolmogorov, 7x Dinitz; the paper's reference code runs networkx's Edmonds-Karp per
  pair, which rebuilds the residual network every time: about 90x slower per pair).

The time grows as ``rows x L x N x L²`` or a little faster: for the ``[CLS]`` row through the
bundled model's 6 layers, 64 tokens took 4 s and 128 tokens 40 s on 2 CPU cores shared with
other work (``benchmarks/results/inspect.md``); ``rows="all"`` multiplies by ``L``.
Inputs longer than ``max_tokens`` (default 128) are refused unless you raise it.

Shape letters: ``N`` layers, ``B`` batch, ``R`` rows, ``L`` length.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from handformer.inspect.rollout import check_attentions, residual_attention

__all__ = ["attention_flow", "MAX_TOKENS", "SCALE", "require_networkx"]

MAX_TOKENS = 128
SCALE = 2**30  # capacities are rounded to multiples of 1 / SCALE (exact integer max-flow)


def require_networkx() -> Any:
    """Import networkx, or say which extra installs it."""
    try:
        import networkx
    except ImportError:  # pragma: no cover - networkx is installed in the test environment
        raise ImportError("attention_flow needs networkx: pip install handformer[inspect]") \
            from None
    return networkx


def _rows(rows: int | Sequence[int] | str, L: int) -> list[int]:
    """Row indices in ``0..L-1`` (negative ones count from the end)."""
    if isinstance(rows, str):
        if rows != "all":
            raise ValueError(f"rows must be an index, a sequence of indices or 'all', got "
                             f"{rows!r}")
        return list(range(L))
    chosen = [rows] if isinstance(rows, int) else list(rows)
    if not chosen:
        raise ValueError("rows is empty: pass at least one output position, e.g. rows=0")
    out = []
    for r in chosen:
        if isinstance(r, bool) or not isinstance(r, int):
            raise TypeError(f"rows must hold integers, got {r!r}")
        if not -L <= r < L:
            raise ValueError(f"row {r} is out of range: the input has {L} positions, valid "
                             f"rows are 0..{L - 1} (or -{L}..-1)")
        out.append(r % L)
    return out


class _LayerGraph:
    """The layer graph of one input, built once, with its residual network, for many pairs.

    Exact reduction: from the source ``(N, i)`` only its own ``L`` edges into layer ``N - 1``
    can carry flow (nothing enters layer ``N``), and into the sink ``(0, j)`` only its ``L``
    edges from layer 1 (the other input nodes are dead ends). So the graph holds layers
    ``1 .. N-1`` plus a source ``"s"`` joined to layer ``N - 1`` and a sink ``"t"`` joined from
    layer 1, and each pair sets those ``2L`` capacities in the residual network (its format
    is documented by networkx: ``R[u][v]["capacity"]``) before the max-flow: ``(N - 2) L²``
    edges instead of ``N L²``, the same flow values.

    Args:
        nx: the networkx module.
        caps: ``N`` integer capacity matrices ``(L, L)``; ``caps[n][a, b]`` is the edge from
            ``(n + 1, a)`` to ``(n, b)``.
    """

    def __init__(self, nx: Any, caps: list[Tensor]) -> None:
        self.caps = caps
        self.N, self.L = len(caps), caps[0].shape[0]
        N, L = self.N, self.L
        G = nx.DiGraph()
        # Placeholder capacities: networkx leaves zero edges out of the residual network,
        # and sizes its "infinite" capacity from the graph's sum.
        G.add_edges_from(("s", (N - 1, k), {"capacity": SCALE}) for k in range(L))
        for n in range(1, N - 1):
            c = caps[n].tolist()  # (L, L) Python ints
            G.add_edges_from(((n + 1, a), (n, b), {"capacity": w})
                             for a, row in enumerate(c) for b, w in enumerate(row) if w > 0)
        G.add_edges_from(((1, m), "t", {"capacity": SCALE}) for m in range(L))
        self.G = G
        self.R = nx.algorithms.flow.build_residual_network(G, "capacity")

    def row(self, i: int, flow_func: Callable[..., Any], bar: Any) -> list[int]:
        """Max-flow values (integers) from output position ``i`` to every input token
        (``bar.update(1)`` after each)."""
        N, L, R = self.N, self.L, self.R
        if N == 1:  # one edge from (1, i) to (0, j)
            bar.update(L)
            return self.caps[0][i].tolist()
        for k, w in enumerate(self.caps[N - 1][i].tolist()):
            R["s"][(N - 1, k)]["capacity"] = w
        values = []
        columns = self.caps[0].T.tolist()  # (L, L): columns[j][m] = edge (1, m) -> (0, j)
        for j in range(L):
            for m, w in enumerate(columns[j]):
                R[(1, m)]["t"]["capacity"] = w
            values.append(flow_func(self.G, "s", "t", capacity="capacity",
                                    residual=R).graph["flow_value"])
            bar.update(1)
        return values


def _solve(nx: Any, mats: Tensor, keep: Tensor, row_list: list[int],
           flow_func: Callable[..., Any], bar: Any, out: Tensor) -> None:
    """Fill ``out`` ``(B, R, L)`` with the flows of every batch element's real tokens."""
    for b in range(keep.shape[0]):
        real = keep[b].nonzero().flatten().tolist()  # positions of real tokens
        index = {p: k for k, p in enumerate(real)}
        sub = mats[:, b][:, real][:, :, real]  # (N, L_real, L_real)
        graph = _LayerGraph(nx, [torch.round(m * SCALE).to(torch.int64) for m in sub])
        for r, pos in enumerate(row_list):
            if pos not in index:
                continue  # a padding row: nothing flows
            values = graph.row(index[pos], flow_func, bar)
            out[b, r, real] = torch.tensor(values, dtype=torch.float64) / SCALE


def attention_flow(attentions: object, *, rows: int | Sequence[int] | str = 0,
                   layers: Sequence[int] | None = None, head_fusion: str = "mean",
                   residual: float = 0.5, attention_mask: Tensor | None = None,
                   normalize: bool = False, max_tokens: int = MAX_TOKENS,
                   flow_func: Callable[..., Any] | None = None,
                   progress: bool | None = None) -> Tensor:
    """Attention flow from output positions to input tokens (one max-flow per pair).

    Args:
        attentions: per-layer ``(B, H, L, L)`` weights, as for
            :func:`~handformer.inspect.rollout.attention_rollout`.
        rows: the output positions: an index (default 0, the ``[CLS]`` token), a sequence
            of indices (negative ones count from the end; ``-1`` = a causal LM's last
            token), or ``"all"``.
        layers: increasing layer indices (default all).
        head_fusion: ``"mean"`` (default), ``"max"`` or ``"min"`` over heads.
        residual: the identity's weight in the capacities (default 0.5, the paper).
        attention_mask: optional ``(B, L)``, 1/True = real token. Padding is left out of the
            graph (its rows and columns of the result are 0) and does not count towards
            ``max_tokens``.
        normalize: divide each row by its sum (so it reads like a rollout row); default the
            raw max-flow values, each at most 1.
        max_tokens: refuse inputs with more real tokens than this (default 128); raise it
            to wait longer (see the module docstring for times).
        flow_func: a networkx max-flow function (default
            ``networkx.algorithms.flow.shortest_augmenting_path``).
        progress: a progress bar over the max-flow problems (default: when there are more
            than 256 and stderr is a terminal).

    Returns:
        ``(B, R, L)`` in the attentions' dtype (float32 for half precision):
        ``out[b, r, j]`` is the flow from output position ``rows[r]`` to input token ``j``,
        exact up to the rounding of capacities to multiples of ``2**-30``.

    Raises:
        ValueError: for an input longer than ``max_tokens`` (the message names the limit
            and the option), a row or layer out of range, or the errors of
            :func:`~handformer.inspect.rollout.residual_attention`.
        ImportError: without networkx (``pip install handformer[inspect]``).
    """
    layer_list = check_attentions(attentions)
    B, _, L, _ = layer_list[0].shape
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    row_list = _rows(rows, L)
    mats = residual_attention(layer_list, layers=layers, head_fusion=head_fusion,
                              residual=residual, attention_mask=attention_mask)
    keep = (torch.ones(B, L, dtype=torch.bool) if attention_mask is None
            else attention_mask.detach().to("cpu") != 0)  # (B, L)
    longest = int(keep.sum(dim=1).max())
    if longest > max_tokens:
        raise ValueError(f"attention_flow: the input has {longest} tokens, over the limit "
                         f"max_tokens={max_tokens} (one max-flow per row and token; the time "
                         f"grows as L^3 per row); pass max_tokens={longest} to wait for it, "
                         f"or use attention_rollout")
    nx = require_networkx()
    if flow_func is None:
        flow_func = nx.algorithms.flow.shortest_augmenting_path
    out = torch.zeros(B, len(row_list), L, dtype=torch.float64)
    real_rows = keep[:, row_list].sum(dim=1)  # (B,) rows that are real tokens
    problems = int((real_rows * keep.sum(dim=1)).sum())
    show = (problems > 256 and sys.stderr.isatty()) if progress is None else progress
    with tqdm(total=problems, desc="attention flow", unit="max-flow", disable=not show) as bar:
        _solve(nx, mats, keep, row_list, flow_func, bar, out)
    if normalize:
        total = out.sum(dim=-1, keepdim=True)  # (B, R, 1)
        out = out / torch.where(total > 0, total, torch.ones_like(total))
    dtype = layer_list[0].dtype
    return out.to(dtype if dtype in (torch.float32, torch.float64) else torch.float32)
