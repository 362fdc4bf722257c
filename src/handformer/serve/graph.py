"""The page's attribution graphs: opened from files (``handformer serve --graph FILE.json``)
or computed for the prompt typed in (``--transcoders PATH``: one transcoder per layer of the
first model), drawn by the graph view of :mod:`handformer.viz.graph_page`.

A :class:`GraphSet` holds the graphs (the files, then the last :data:`MAX_COMPUTED` computed
ones), computes a new one with :func:`~handformer.features.attribution_graph` — one at a
time: a second request while one runs is told so (429) — and makes the feature cards the view
shows on hover: the contexts where a transcoder feature fired most in the built-in sample
texts of the Features view and the prompts graphed here, and the tokens its decoder row
promotes and suppresses (the Features view's card, :mod:`handformer.serve.features`).

Graph work runs on a private copy of the model's module tree that shares every parameter
(``copy.deepcopy`` told to keep the tensors): the replacement model registers forward
pre-hooks on the MLP modules, which on the served modules would see the other requests'
forward passes.

Shape letters: ``L`` tokens, ``F`` features, ``K`` kept per token.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from handformer.features.dictionary import Transcoder
from handformer.features.graph import AttributionGraph
from handformer.serve.features import (
    MAX_SEEN,
    SAMPLES,
    Record,
    logit_rows,
    records_card,
    sparse_top,
)

__all__ = ["GraphSet", "GraphEntry", "GraphBusy", "private_model", "MAX_GRAPH_TOKENS",
           "MAX_FEATURE_NODES", "DEFAULT_FEATURE_NODES", "MAX_COMPUTED"]

MAX_GRAPH_TOKENS = 64  # prompt tokens a graph may have (time grows with them)
MAX_FEATURE_NODES = 4096
DEFAULT_FEATURE_NODES = 256
MAX_COMPUTED = 8  # computed graphs kept (the oldest goes)


class GraphBusy(RuntimeError):
    """A graph is being computed; the server computes one at a time."""


def private_model(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s modules sharing every parameter and buffer (a few KB), whose
    module hooks no other request sees.

    Args:
        model: the served model.
    """
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo=shared).eval()


@dataclass
class GraphEntry:
    """One graph the page can show.

    Attributes:
        id: its name in the API (``file-1``, ``computed-3``).
        graph: the graph.
        source: the file it came from, or the prompt it was computed for.
        prompt_tokens: the prompt's token labels.
        logit_tokens: the logit nodes' token labels, or None where no tokenizer applies.
        seconds: how long it took to compute (None for a file).
        view: the view's data, made once (:func:`~handformer.features.graph_view_data`).
    """

    id: str
    graph: AttributionGraph
    source: str
    prompt_tokens: list[str]
    logit_tokens: list[str] | None = None
    seconds: float | None = None
    view: dict[str, Any] | None = field(default=None, repr=False)

    def describe(self) -> dict[str, object]:
        """What ``GET /api/graph`` lists for it."""
        g = self.graph
        return {"id": self.id, "source": self.source, "tokens": g.n_positions,
                "features": g.n_features, "nodes": int(g.adjacency.shape[0]),
                "replacement_score": _finite(g.replacement_score),
                "completeness_score": _finite(g.completeness_score), "seconds": self.seconds}


def _finite(x: float) -> float | None:
    return x if x == x and abs(x) != float("inf") else None


class GraphSet:
    """The graphs a server offers, and (with transcoders) what computes new ones.

    Args:
        state: the first model (:class:`~handformer.serve.state.ModelState`).
        transcoders: one transcoder (or None) per layer of that model, or None: the page
            shows the files only (without cards).
        files: ``(name, graph)`` pairs read from ``--graph``.

    Raises:
        ValueError: transcoders for an encoder or of another width (the replacement model's
            check), a graph file whose layers or features do not fit the transcoders.
    """

    def __init__(self, state: Any, transcoders: Sequence[Transcoder | None] | None = None,
                 files: Sequence[tuple[str, AttributionGraph]] = ()) -> None:
        from handformer.features.replacement import check_transcoders

        self.state = state
        self.transcoders = None
        if transcoders is not None:
            if not state.causal:
                raise ValueError(f"transcoders need a causal language model; {state.name} is "
                                 "an encoder")
            self.transcoders = [None if t is None else t.to(state.device).eval()
                                for t in check_transcoders(state.model, transcoders)]
        self.entries: OrderedDict[str, GraphEntry] = OrderedDict()
        self._count = 0
        for name, graph in files:
            self._check_fits(name, graph)
            self._count += 1
            tokens = graph.prompt_tokens or [str(int(t)) for t in graph.input_ids]
            entry = GraphEntry(f"file-{self._count}", graph, name, list(tokens),
                               self._logit_labels(graph) if self.transcoders else None)
            self.entries[entry.id] = entry
        self._lock = threading.Lock()  # the entries and the seen records
        self._busy = threading.Lock()  # one computation at a time
        self.busy_since: float | None = None
        self._records: list[list[Record]] | None = None
        self._seen: deque[list[Record]] = deque(maxlen=MAX_SEEN)

    def _check_fits(self, name: str, graph: AttributionGraph) -> None:
        if self.transcoders is None:
            return
        n = len(self.transcoders)
        if graph.n_layers != n:
            raise ValueError(f"{name}: a graph of {graph.n_layers} layers; the transcoders are "
                             f"for {n} (a graph of another model)")
        for layer, _, f in graph.features.tolist():
            tc = self.transcoders[layer]
            if tc is None or f >= tc.d_sae:
                have = "no transcoder" if tc is None else f"{tc.d_sae} features"
                raise ValueError(f"{name}: feature {f} of layer {layer}, where the transcoders "
                                 f"have {have} (a graph of other transcoders)")

    def _logit_labels(self, graph: AttributionGraph) -> list[str] | None:
        from handformer.tokenizers.labels import token_labels

        tok = self.state.tokenizer
        try:
            return [token_labels(tok, [int(t)])[0] for t in graph.logit_tokens]
        except (ValueError, IndexError, KeyError):
            return None

    @property
    def can_compute(self) -> bool:
        """Whether new graphs can be computed (transcoders given)."""
        return self.transcoders is not None

    def describe(self) -> dict[str, object]:
        """``GET /api/graph``: the graphs, and what computing one takes."""
        with self._lock:
            graphs = [e.describe() for e in self.entries.values()]
        since = self.busy_since
        return {"graphs": graphs, "compute": self.can_compute, "cards": self.can_compute,
                "model": self.state.name if self.can_compute else None,
                "computing": None if since is None else round(time.time() - since, 1),
                "limits": {"max_tokens": MAX_GRAPH_TOKENS, "max_feature_nodes":
                           MAX_FEATURE_NODES, "default_feature_nodes": DEFAULT_FEATURE_NODES}}

    def get(self, graph_id: str | None) -> GraphEntry:
        """The graph ``graph_id`` (None: the newest).

        Raises:
            KeyError: naming the graphs there are.
        """
        with self._lock:
            if graph_id is None and self.entries:
                return next(reversed(self.entries.values()))
            if graph_id in self.entries:
                return self.entries[graph_id]
            names = ", ".join(self.entries) or "none yet"
        raise KeyError(f"no graph {graph_id!r}; graphs: {names}")

    def view(self, entry: GraphEntry) -> dict[str, Any]:
        """The view's data of ``entry`` (made once).

        Args:
            entry: the graph.
        """
        from handformer.features.graph_view import graph_view_data

        if entry.view is None:
            entry.view = graph_view_data(entry.graph, prompt_tokens=entry.prompt_tokens,
                                         logit_tokens=entry.logit_tokens, slug=entry.id)
            entry.view["view"]["source"] = entry.source
        return entry.view

    def compute(self, ids: list[int], *, target: int | None, max_feature_nodes: int
                ) -> GraphEntry:
        """The graph of ``ids`` (targets: the top logits, or ``target``'s).

        Args:
            ids: the prompt's token ids.
            target: a token id, or None for the most likely next tokens.
            max_feature_nodes: the cap on feature nodes.

        Returns:
            The new entry (kept among the graphs).

        Raises:
            GraphBusy: while another graph is being computed.
        """
        from handformer.features.graph import attribution_graph
        from handformer.tokenizers.labels import token_labels

        if not self._busy.acquire(blocking=False):
            since = self.busy_since or time.time()
            raise GraphBusy(f"a graph is being computed (for {time.time() - since:.0f} s); the "
                            "server computes one at a time: wait for it")
        try:
            self.busy_since = time.time()
            start = time.perf_counter()
            model = private_model(self.state.model)
            t = torch.tensor(ids, device=self.state.device)
            graph = attribution_graph(model, self.transcoders, t,
                                      targets=None if target is None else [target],
                                      max_feature_nodes=max_feature_nodes)
            seconds = round(time.perf_counter() - start, 3)
            self._remember(model, ids)
        finally:
            self.busy_since = None
            self._busy.release()
        tok = self.state.tokenizer
        with self._lock:
            self._count += 1
            entry = GraphEntry(f"computed-{self._count}", graph, tok.decode(ids)[:200],
                               token_labels(tok, ids), self._logit_labels(graph), seconds)
            self.entries[entry.id] = entry
            computed = [k for k in self.entries if k.startswith("computed-")]
            for old in computed[:max(0, len(computed) - MAX_COMPUTED)]:
                del self.entries[old]
        return entry

    # ---- cards ------------------------------------------------------------------------------
    def _read(self, model: nn.Module, ids: list[int], source: str) -> list[Record]:
        """Each layer's sparse transcoder activations on ``ids`` (one forward pass)."""
        inputs: dict[int, torch.Tensor] = {}
        handles = [layer.mlp.register_forward_pre_hook(
            lambda module, args, i=i: inputs.__setitem__(i, args[0].detach()))
            for i, layer in enumerate(model.blocks) if self.transcoders[i] is not None]
        try:
            with torch.inference_mode():
                model(input_ids=torch.tensor([ids], device=self.state.device))
                out = []
                for i, tc in enumerate(self.transcoders):
                    if tc is None:
                        out.append(Record(list(ids), source, torch.zeros(len(ids), 0,
                                                                          dtype=torch.int32),
                                          torch.zeros(len(ids), 0)))
                        continue
                    acts = tc.encode(inputs[i][0].to(tc.dtype))  # (L, F)
                    indices, values = sparse_top(acts)
                    out.append(Record(list(ids), source, indices.cpu(), values.cpu()))
        finally:
            for h in handles:
                h.remove()
        return out

    def _remember(self, model: nn.Module, ids: list[int]) -> None:
        records = self._read(model, ids, "seen")
        with self._lock:
            if all(r[0].ids != ids for r in self._seen):
                self._seen.append(records)

    def _samples(self) -> list[list[Record]]:
        with self._lock:
            if self._records is not None:
                return self._records
        model = private_model(self.state.model)
        made = []
        for text in SAMPLES:
            try:
                ids = self.state.tokenizer.encode(text)[:self.state.max_tokens]
            except ValueError:  # a character vocabulary without these letters
                continue
            if len(ids) >= 2:
                made.append(self._read(model, ids, "sample"))
        with self._lock:
            self._records = made
        return made

    def card(self, layer: int, feature: int) -> dict[str, object]:
        """Feature ``feature`` of layer ``layer``'s card (the Features view's fields).

        Args:
            layer: the transcoder's layer (one that has a transcoder).
            feature: the feature index.

        Returns:
            ``{"contexts", "density", "tokens_seen", "texts_seen", "promoted",
            "suppressed"}``.
        """
        samples = self._samples()
        with self._lock:
            seen = list(self._seen)
        records = [r[layer] for r in samples + seen]
        return records_card(self.state, records, feature) | logit_rows(
            self.state, self.transcoders[layer], feature)
