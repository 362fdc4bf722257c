"""An attribution graph to and from the JSON that circuit-tracer's page and Neuronpedia read.

The file is one object (circuit-tracer's ``frontend/graph_models.py`` schema, version 1)::

    {"metadata": {"slug", "scan", "transcoder_list", "prompt_tokens", "prompt",
                  "node_threshold", "schema_version": 1},
     "qParams": {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "",
                 "sg_pos": ""},
     "nodes": [{"node_id", "feature", "layer", "ctx_idx", "feature_type", "token_prob",
                "is_target_logit", "run_idx", "reverse_ctx_idx", "jsNodeId", "clerp",
                "influence", "activation"}, ...],
     "links": [{"source": node_id, "target": node_id, "weight": direct effect}, ...]}

Node ids: a feature ``"{layer}_{feature}_{pos}"``, an error ``"{layer}_-1_{pos}"``, a token
``"E_{token id}_{pos}"``, a logit ``"{n_layers + 1}_{token id}_{pos}"``. A logit difference is
written as its first token's logit node (the clerp says which difference). Only the nodes and
edges a :class:`~handformer.features.influence.Pruned` keeps are written, when one is given.
``qParams.supernodes`` holds named groups ``[name, node_id, ...]`` (Neuronpedia's subgraph
shows each as one node); their members are written as ``pinnedIds`` too.

:func:`load_graph_json` reads such a file back into an :class:`AttributionGraph` (adjacency,
features, logits; pre-activations and constants are not in the format: NaN).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from handformer.features.graph import AttributionGraph
from handformer.features.influence import Pruned

__all__ = ["graph_to_json", "save_graph_json", "load_graph_json", "GraphFileError",
           "MAX_NODES", "node_ids", "check_supernodes"]

MAX_NODES = 16384  # a dense adjacency of this many nodes is 1 GiB in float32
MAX_BYTES = 1 << 30  # a graph file larger than this is refused before it is read


class GraphFileError(ValueError):
    """A graph JSON file that cannot be read (names the file and the field)."""


def node_ids(graph: AttributionGraph) -> list[str]:
    """Every node's id in the file's convention (see the module docs), in the graph's order.

    Args:
        graph: the graph.
    """
    ids = [f"{layer}_{f}_{pos}" for layer, pos, f in graph.features.tolist()]
    ids += [f"{layer}_-1_{pos}" for layer in range(graph.n_layers)
            for pos in range(graph.n_positions)]
    ids += [f"E_{int(t)}_{pos}" for pos, t in enumerate(graph.input_ids)]
    ids += [f"{graph.n_layers + 1}_{int(t)}_{graph.logit_position}" for t in graph.logit_tokens]
    return ids


def check_supernodes(supernodes: Any, known: set[str] | dict[str, Any]) -> list[list[str]]:
    """Check ``[[name, node_id, ...], ...]``: a name and at least one member each, members
    among ``known``, no node in two groups, no name twice.

    Args:
        supernodes: the groups (None: none).
        known: the node ids that exist.

    Returns:
        The groups, as lists of strings.

    Raises:
        ValueError: naming the first bad group.
    """
    groups: list[list[str]] = []
    seen: dict[str, str] = {}
    for group in supernodes or []:
        if not (isinstance(group, list) and len(group) >= 2
                and all(isinstance(g, str) for g in group)):
            raise ValueError(f"supernodes: each group is [name, node_id, ...], got "
                             f"{str(group)[:80]}")
        unknown = [g for g in group[1:] if g not in known]
        if unknown:
            raise ValueError(f"supernodes: {group[0]!r} names nodes not in the graph (or "
                             f"pruned away): {unknown[:5]}")
        if any(g[0] == group[0] for g in groups):
            raise ValueError(f"supernodes: two groups are named {group[0]!r}")
        twice = [g for g in group[1:] if g in seen or group[1:].count(g) > 1]
        if twice:
            raise ValueError(f"supernodes: {group[0]!r} and {seen.get(twice[0], group[0])!r} "
                             f"both hold {twice[0]!r}; a node belongs to one group, once")
        seen.update(dict.fromkeys(group[1:], group[0]))
        groups.append(list(group))
    return groups


def graph_to_json(graph: AttributionGraph, *, slug: str = "handformer-graph",
                  prompt_tokens: list[str] | None = None, pruned: Pruned | None = None,
                  scan: str = "handformer", node_threshold: float | None = None,
                  supernodes: list[list[str]] | None = None) -> dict[str, Any]:
    """The graph as circuit-tracer's JSON object (see the module docs).

    Args:
        graph: the graph.
        slug: the graph's name in the page.
        prompt_tokens: the prompt's token strings (default: the graph's ``prompt_tokens``,
            else the ids as strings).
        pruned: write only what it keeps (default: every node and non-zero edge).
        scan: the model / transcoder set's name (Neuronpedia's ``scan``).
        node_threshold: recorded in the metadata.
        supernodes: groups the page shows collapsed: ``[[name, node_id, ...], ...]`` (the
            page's ``qParams.supernodes``; their members are also written as its
            ``pinnedIds``); every node id must be among the nodes written. Default: the
            graph's ``supernodes``.

    Raises:
        ValueError: for prompt_tokens of the wrong length, a supernode naming a node that is
            not written.
    """
    L = graph.n_positions
    tokens = prompt_tokens if prompt_tokens is not None else graph.prompt_tokens
    tokens = tokens if tokens is not None else [str(int(t)) for t in graph.input_ids]
    if len(tokens) != L:
        raise ValueError(f"prompt_tokens has {len(tokens)} entries, the graph {L} positions")
    supernodes = graph.supernodes if supernodes is None else supernodes
    ids = node_ids(graph)
    N = len(ids)
    node_mask = pruned.node_mask if pruned is not None else torch.ones(N, dtype=torch.bool)
    edge_mask = pruned.edge_mask if pruned is not None else graph.adjacency != 0
    influence = graph.influence()
    nodes: list[dict[str, Any]] = []
    n_f, errors, toks = graph.n_features, graph.errors, graph.tokens
    for i in range(N):
        if not node_mask[i]:
            continue
        node: dict[str, Any] = {"node_id": ids[i], "run_idx": 0, "reverse_ctx_idx": 0,
                                "token_prob": 0.0, "is_target_logit": False, "clerp": "",
                                "influence": float(influence[i]), "activation": None}
        if i < n_f:
            layer, pos, f = graph.features[i].tolist()
            node.update(feature=(layer + f) * (layer + f + 1) // 2 + f, layer=str(layer),
                        ctx_idx=pos, feature_type="cross layer transcoder",
                        jsNodeId=f"{layer}_{f}-0", activation=float(graph.activations[i]))
        elif i < errors.stop:
            layer, pos = divmod(i - errors.start, L)
            node.update(feature=-1, layer=str(layer), ctx_idx=pos,
                        feature_type="mlp reconstruction error", jsNodeId=f"{layer}_-1-{pos}")
        elif i < toks.stop:
            pos = i - toks.start
            node.update(feature=pos, layer="E", ctx_idx=pos, feature_type="embedding",
                        jsNodeId=f"E_{int(graph.input_ids[pos])}-{pos}", clerp=tokens[pos])
        else:
            k = i - graph.logits.start
            t, minus = int(graph.logit_tokens[k]), int(graph.logit_minus[k])
            p = float(graph.logit_weights[k])
            what = f"logit {t}" + (f" minus logit {minus}" if minus >= 0 else "")
            node.update(feature=t, layer=str(graph.n_layers + 1), ctx_idx=graph.logit_position,
                        feature_type="logit", token_prob=p, is_target_logit=k == 0,
                        jsNodeId=f"L_{t}-{graph.logit_position}",
                        clerp=f"Output {what} (p={p:.3f})")
        nodes.append(node)
    groups = check_supernodes(supernodes, {node["node_id"] for node in nodes})
    targets, sources = edge_mask.nonzero(as_tuple=True)
    links = [{"source": ids[s], "target": ids[t], "weight": float(graph.adjacency[t, s])}
             for t, s in zip(targets.tolist(), sources.tolist(), strict=True)]
    return {"metadata": {"slug": slug, "scan": scan, "transcoder_list": [],
                         "prompt_tokens": tokens, "prompt": "".join(tokens),
                         "node_threshold": node_threshold, "schema_version": 1},
            "qParams": {"pinnedIds": list(dict.fromkeys(g for group in groups
                                                        for g in group[1:])),
                        "supernodes": groups, "linkType": "both", "clickedId": "",
                        "sg_pos": ""},
            "nodes": nodes, "links": links}


def save_graph_json(graph: AttributionGraph, path: str | os.PathLike, **options: Any) -> Path:
    """Write :func:`graph_to_json` to ``path`` (a temporary file, then renamed).

    Args:
        graph: the graph.
        path: the ``.json`` file.
        **options: as :func:`graph_to_json`.

    Returns:
        The path written.
    """
    path = Path(path)
    data = graph_to_json(graph, **options)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _field(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj or not isinstance(obj[key], kind) or (
            kind is int and isinstance(obj[key], bool)):
        raise GraphFileError(f"{where}: field {key!r} is missing or not "
                             f"{getattr(kind, '__name__', kind)}")
    return obj[key]


def load_graph_json(path: str | os.PathLike) -> AttributionGraph:
    """Read a circuit-tracer / Neuronpedia graph file into an :class:`AttributionGraph`.

    Args:
        path: the ``.json`` file.

    Returns:
        The graph: its nodes in handformer's order, the adjacency from the links; no
        pre-activations or constants (NaN), scores recomputed; ``prompt_tokens`` and
        ``supernodes`` from the file's ``metadata`` and ``qParams``.

    Raises:
        GraphFileError: (a ``ValueError``) for a file that is not such a graph, more than
            :data:`MAX_NODES` nodes, a link to an unknown node, a supernode naming one,
            naming the file and field.
    """
    where = str(path)
    try:
        size = Path(path).stat().st_size
    except OSError as e:
        raise GraphFileError(f"{where}: not a readable JSON file ({e})") from None
    if size > MAX_BYTES:
        raise GraphFileError(f"{where}: {size} bytes, more than MAX_BYTES = {MAX_BYTES}")
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GraphFileError(f"{where}: not a readable JSON file ({e})") from None
    nodes = _field(data, "nodes", list, where)
    links = _field(data, "links", list, where)
    if len(nodes) > MAX_NODES or len(links) > MAX_NODES ** 2:
        raise GraphFileError(f"{where}: {len(nodes)} nodes, more than MAX_NODES = {MAX_NODES}"
                             " (or more links than node pairs)")
    feats, errs, embeds, logits = [], [], [], []
    for n, node in enumerate(nodes):
        at = f"{where}: nodes[{n}]"
        kind = _field(node, "feature_type", str, at)
        node_id = _field(node, "node_id", str, at)
        pos = _field(node, "ctx_idx", int, at)
        if pos < 0:
            raise GraphFileError(f"{at}: ctx_idx {pos} is negative")
        parts = node_id.split("_")
        if len(parts) != 3 or not all(p.lstrip("-").isdigit() for p in parts[1:]) or (
                parts[0] != "E" and not parts[0].isdigit()):
            raise GraphFileError(f"{at}: node_id {node_id!r} is not 'layer_feature_pos'")
        if kind == "cross layer transcoder":
            layer, f = int(parts[0]), int(parts[1])
            feats.append((layer, pos, f, float(node.get("activation") or 0.0), node_id))
        elif kind == "mlp reconstruction error":
            errs.append((int(_field(node, "layer", str, at)), pos, node_id))
        elif kind == "embedding":
            embeds.append((pos, int(parts[1]), node_id))
        elif kind == "logit":
            logits.append((int(_field(node, "feature", int, at)),
                           float(node.get("token_prob", 0.0)), pos, node_id))
        else:
            raise GraphFileError(f"{at}: unknown feature_type {kind!r}")
    L = max([p for p, _, _ in embeds] + [p for _, p, _ in errs] + [-1]) + 1
    n_layers = max([la for la, _, _ in errs] + [la for la, *_ in feats] + [-1]) + 1
    if (n_layers + 1) * L + len(feats) + len(logits) > MAX_NODES or any(
            la < 0 for la, _, _ in errs):
        raise GraphFileError(f"{where}: {n_layers} layers x {L} positions of error and token "
                             f"nodes is more than MAX_NODES = {MAX_NODES} (or a layer < 0)")
    ids = torch.zeros(L, dtype=torch.long)
    for pos, tok, _ in embeds:
        ids[pos] = tok
    order = [f[-1] for f in feats]
    order += [f"{la}_-1_{p}" for la in range(n_layers) for p in range(L)]
    order += [f"E_{int(ids[p])}_{p}" for p in range(L)]
    order += [lg[-1] for lg in logits]
    index = {node_id: i for i, node_id in enumerate(order)}
    N = len(order)
    A = torch.zeros(N, N, dtype=torch.float32)
    for k, link in enumerate(links):
        at = f"{where}: links[{k}]"
        s, t = _field(link, "source", str, at), _field(link, "target", str, at)
        w = _field(link, "weight", (int, float), at)
        if s not in index or t not in index or not math.isfinite(w):
            raise GraphFileError(f"{at}: unknown node {s if s not in index else t!r} or a "
                                 "weight that is not finite")
        A[index[t], index[s]] = w
    nan = torch.full((N,), float("nan"))
    probs = torch.tensor([p for _, p, _, _ in logits], dtype=torch.float64)
    graph = AttributionGraph(
        ids, n_layers, torch.tensor([f[:3] for f in feats], dtype=torch.long).view(-1, 3),
        torch.tensor([f[3] for f in feats]), torch.tensor([t for t, *_ in logits]),
        torch.full((len(logits),), -1), probs,
        logits[0][2] if logits else L - 1, A, nan, nan.clone(), order)
    meta = data.get("metadata")
    tokens = meta.get("prompt_tokens") if isinstance(meta, dict) else None
    if isinstance(tokens, list) and len(tokens) == L and all(isinstance(t, str) for t in tokens):
        graph.prompt_tokens = list(tokens)
    q = data.get("qParams")
    try:
        graph.supernodes = check_supernodes(q.get("supernodes") if isinstance(q, dict) else None,
                                            index)
    except ValueError as e:
        raise GraphFileError(f"{where}: qParams.{e}") from None
    graph.replacement_score, graph.completeness_score = graph.scores()
    return graph
