"""Speed of ``handformer.inspect`` on the bundled all-MiniLM-L6-v2 (6 layers x 12 heads).

One function per part, each returning a dict for the JSON file and markdown lines for the
report; ``results/inspect.json`` / ``inspect.md`` hold every part measured so far (running
one part keeps the others' recorded results).

* ``flow`` - attention flow for 64 tokens, the ``[CLS]`` row (64 max-flow problems), target
  <= 30 s on 2 cores. Reference, in the same run: the paper's way, networkx's
  ``maximum_flow_value`` with Edmonds-Karp per (output, input) pair on the float graph
  (built once), timed on a few pairs; the ratio is per pair. Also the limit: the ``[CLS]``
  row at ``MAX_TOKENS`` = 128 tokens, and every row of a 16-token input.

Usage: ``python benchmarks/bench_inspect.py [PART ...]`` (``HANDFORMER_BENCH_QUICK=1`` for a
quick smoke run).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import QUICK, RESULTS, machine, machine_line, write_results  # noqa: E402

TEXT = ("The animal didn't cross the street because it was too tired. It had walked all day "
        "long under the sun, and every car that went by made it jump back to the pavement. ")
FLOW_TARGET_S = 30.0


def _attentions(tokens: int) -> tuple[object, int]:
    """The bundled model's attentions on ``TEXT`` repeated and cut to ``tokens`` tokens."""
    import warnings

    import torch

    from handformer.pretrained import load_bert

    model, tokenizer = load_bert()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # cut to length on purpose
        enc = tokenizer.encode_batch([TEXT * 20], max_length=tokens)
    with torch.inference_mode():
        out = model(**tokenizer.pad(enc), need_weights=True)
    return out.attentions, len(enc[0].ids)


def _paper_graph(attentions: object) -> tuple[object, int]:
    """The reference's graph: float capacities, built once (as the paper's code does)."""
    import networkx as nx

    from handformer.inspect import residual_attention

    mats = residual_attention(attentions)[:, 0].numpy()  # (N, L, L)
    N, L, _ = mats.shape
    G = nx.DiGraph()
    for n in range(N):
        for a in range(L):
            for b in range(L):
                G.add_edge((n + 1, a), (n, b), capacity=float(mats[n, a, b]))
    return G, N


def _paper_pair(G: object, N: int, i: int, j: int) -> float:
    """The reference: ``maximum_flow_value`` with Edmonds-Karp for the pair ``(i, j)``."""
    import networkx as nx

    return nx.maximum_flow_value(G, (N, i), (0, j), flow_func=nx.algorithms.flow.edmonds_karp)


def bench_flow() -> tuple[dict[str, object], list[str]]:
    from handformer.inspect import attention_flow
    from handformer.inspect.flow import MAX_TOKENS

    tokens = 16 if QUICK else 64
    att, L = _attentions(tokens)
    runs = []
    for _ in range(1 if QUICK else 3):
        start = time.perf_counter()
        row = attention_flow(att)  # the [CLS] row: L max-flow problems
        runs.append(time.perf_counter() - start)
    cls_s = statistics.median(runs)
    pairs = [(0, 1), (0, L // 2)] if QUICK else [(0, 1), (0, L // 2), (5, 7), (L - 1, 3)]
    ref_runs, agree = [], True
    G, N = _paper_graph(att)
    for i, j in pairs:
        start = time.perf_counter()
        value = _paper_pair(G, N, i, j)
        ref_runs.append(time.perf_counter() - start)
        if i == 0:
            agree &= abs(value - float(row[0, 0, j])) < 1e-6
    ref_pair_s = statistics.median(ref_runs)
    ours_pair_s = cls_s / L
    data: dict[str, object] = {
        "tokens": L, "layers": len(att), "cls_row_s": cls_s, "runs": runs,
        "per_pair_s": ours_pair_s, "paper_per_pair_s": ref_pair_s,
        "paper_pair_runs": ref_runs, "speedup_per_pair": ref_pair_s / ours_pair_s,
        "paper_all_pairs_estimate_s": ref_pair_s * L * L, "agrees_with_reference": agree,
        "target_s": FLOW_TARGET_S, "within_target": cls_s <= FLOW_TARGET_S,
    }
    lines = [
        "## Attention flow",
        "",
        "| measurement | value |",
        "|---|---|",
        f"| `attention_flow`, [CLS] row, {L} tokens x {len(att)} layers ({L} max-flows, "
        f"median of {len(runs)}) | {cls_s:.2f} s |",
        f"| target <= {FLOW_TARGET_S:.0f} s | {'met' if data['within_target'] else 'missed'} |",
        f"| per (output, input) pair: handformer / the paper's way (networkx Edmonds-Karp "
        f"per pair on the float graph, median of {len(pairs)} pairs) | "
        f"{ours_pair_s * 1e3:.0f} ms / "
        f"{ref_pair_s * 1e3:.0f} ms = {data['speedup_per_pair']:.0f}x faster |",
        f"| the paper's way for all {L * L} pairs (estimate) | "
        f"{data['paper_all_pairs_estimate_s'] / 60:.0f} min |",
        f"| values agree with the reference (1e-6) | {'yes' if agree else 'NO'} |",
    ]
    if not QUICK:
        att128, L128 = _attentions(MAX_TOKENS)
        start = time.perf_counter()
        attention_flow(att128)
        data["cls_row_max_tokens_s"] = time.perf_counter() - start
        att16, L16 = _attentions(16)
        start = time.perf_counter()
        attention_flow(att16, rows="all")
        data["all_rows_16_s"] = time.perf_counter() - start
        lines += [
            f"| [CLS] row at the default limit max_tokens={L128} | "
            f"{data['cls_row_max_tokens_s']:.1f} s |",
            f"| every row (`rows=\"all\"`), {L16} tokens ({L16 * L16} max-flows) | "
            f"{data['all_rows_16_s']:.1f} s |",
        ]
    return data, lines + [""]


PARTS: dict[str, Callable[[], tuple[dict[str, object], list[str]]]] = {"flow": bench_flow}


def main(names: list[str]) -> int:
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        print(f"unknown part(s) {', '.join(unknown)}; parts are {', '.join(PARTS)}")
        return 2
    previous: dict[str, object] = {}
    recorded = RESULTS / "inspect.json"
    if recorded.is_file() and not QUICK:
        previous = json.loads(recorded.read_text(encoding="utf-8")).get("parts", {})
    parts = dict(previous)
    for name in names or list(PARTS):
        load_before = os.getloadavg()[0]
        data, lines = PARTS[name]()
        parts[name] = {"machine": machine(), "data": data, "markdown": lines,
                       "load_average_start_end": [round(load_before, 2),
                                                  round(os.getloadavg()[0], 2)]}
        print("\n".join(lines))
    markdown = ["# handformer.inspect: speed", "", f"Last run: {machine_line()}", ""]
    for name in PARTS:  # a fixed order, whatever was run this time
        if name in parts:
            markdown += parts[name]["markdown"]  # type: ignore[index]
    write_results("inspect", {"machine": machine(), "parts": parts}, "\n".join(markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
