"""Attribution graphs on CPU: one graph of a 16-token prompt on SmolLM2-135M.

Random transcoders of ``--features`` (default 2,048) features per layer, TopK with
``--k`` active per position (so the graph has ``30 × 16 × k`` active features to choose from),
one per MLP, in float32; ``--max-feature-nodes`` kept by influence (circuit-tracer's cap).
Reports the seconds of each stage (:attr:`AttributionGraph.timings`), the peak resident memory
of the process (``ru_maxrss``), the graph's size and its replacement / completeness scores
(random transcoders explain little: the scores say so; the timing is what this measures).

``--transcoders FOLDER`` times the same graph with a trained set (what
``bench_features.py --only transcoders`` builds) instead of random transcoders, so the scores
mean something.

Usage: ``python benchmarks/bench_graphs.py [--model PATH]`` (default the shipped
SmolLM2-135M-Instruct .gguf). ``HANDFORMER_BENCH_QUICK=1``: a 4-layer random model of its
width, 64 features, one small graph.

``--trained [FOLDER]``: the tutorial's chapter 13 on the trained transcoder set instead
(``benchmarks/bench_features.py --only transcoders`` writes it into FOLDER, by default
``~/.cache/handformer/transcoders/smollm2-135m-instruct``: one
``dictionaries/blocks.N.hook_mlp_out`` per layer). The code of sections 13.2 to 13.7 is read
from docs/tutorial.en.md and run as it stands, with two changes: the trained set replaces the
tiny transcoders the chapter trains (the training loop is skipped, its functions kept), and
``max_feature_nodes`` is ``--max-feature-nodes`` (default 512 here). Prints what the blocks
print (the figures the chapter's "With the trained set" part quotes), each block's seconds,
and the top features' contexts in ``--corpus-tokens`` tokens of the offline ``en`` corpus.
Writes nothing under benchmarks/results; the chapter's files (paris_graph.png,
paris_graph.json) go to ``--out``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import os
import re
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import QUICK, machine, machine_line, write_results  # noqa: E402
from handformer import CausalLM, CausalLMConfig  # noqa: E402
from handformer.features import Transcoder, attribution_graph  # noqa: E402

PROMPT = ("The capital of France is Paris, and the capital of Italy is Rome. The capital of "
          "Spain is")
TUTORIAL = Path(__file__).resolve().parents[1] / "docs" / "tutorial.en.md"
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)


def load(source: str | None) -> tuple[CausalLM, torch.Tensor, str]:
    """The model, a 16-token prompt and the model's name."""
    if QUICK:
        torch.manual_seed(0)
        model = CausalLM(CausalLMConfig(vocab_size=1000, max_len=64, d_model=64, num_heads=4,
                                        num_layers=4, d_ff=128, positional="rotary",
                                        norm="rms", mlp="gated", activation="silu",
                                        bias=False, num_kv_heads=2)).eval()
        return model, torch.randint(0, 1000, (16,)), "random 4-layer model"
    from handformer.pretrained import load_lm
    from handformer.pretrained.gguf.shipped import shipped_path

    path = source or shipped_path("smollm2-135m-instruct")
    model, tokenizer = load_lm(path)
    ids = torch.tensor(tokenizer.encode(PROMPT))[:16]
    return model.eval(), ids, Path(path).name


def chapter_blocks(start: str = "### 13.2", stop: str = "### 13.8") -> list[tuple[int, str]]:
    """``(line, code)`` of the shared python blocks of tutorial.en.md between two headings."""
    text = TUTORIAL.read_text(encoding="utf-8")
    a, b = text.index(f"\n{start}"), text.index(f"\n{stop}")
    return [(text.count("\n", 0, m.start()) + 2, m.group(2))
            for m in FENCE.finditer(text, a, b) if m.group(1).strip() == "python"]


def definitions_only(code: str) -> str:
    """The imports and function definitions of a block (its training loop left out)."""
    tree = ast.parse(code)
    keep = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom, ast.FunctionDef))]
    return ast.unparse(ast.Module(body=keep, type_ignores=[]))


def corpus_contexts(model: torch.nn.Module, tok: object, transcoders: list, graph: object,
                    nodes: list[int], tokens: int) -> None:
    """Print where each feature node's feature is largest in ``tokens`` of the en corpus."""
    from handformer.features import load_corpus
    from handformer.features.stream import ActivationReader, parse_sites, tokenize_corpus

    ids = tokenize_corpus(load_corpus("en"), tok, max_tokens=tokens).long()
    W = 128  # tokens per window, the BOS in front as in training
    windows = ids[:len(ids) // W * W].view(-1, W)  # (B, W)
    windows = torch.cat([torch.full((len(windows), 1), tok.bos_token_id), windows], 1)
    feats = [graph.features[n].tolist() for n in nodes]  # (layer, position, feature)
    layers = sorted({f[0] for f in feats})
    reader = ActivationReader(model, parse_sites(
        model, [f"blocks.{i}.hook_mlp_out" for i in layers], transcoder=True))
    acts: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    with torch.no_grad():
        for start in range(0, len(windows), 8):
            read = reader.read(windows[start:start + 8])
            for i in layers:
                x, _ = read[f"blocks.{i}.hook_mlp_out"]
                acts[i].append(transcoders[i].encode(x))  # (rows, d_sae)
    flat = windows[:, 1:].reshape(-1)  # the tokens of the rows, in order
    print(f"\n--- contexts in {len(flat)} tokens of the en corpus")
    for n, (layer, _, f) in zip(nodes, feats, strict=True):
        z = torch.cat(acts[layer])[:, f]  # (N,)
        shown = [tok.decode(flat[max(i - 6, 0):i].tolist()) + "⟦" +
                 tok.decode(flat[i:i + 1].tolist()) + "⟧" for i in z.topk(4).indices.tolist()]
        print(f"{graph.node_labels[n]:>12} fires on {float((z > 0).float().mean()):.2%} of "
              f"tokens; largest: {shown}")


def trained(folder: Path, max_nodes: int, out: Path, corpus_tokens: int) -> None:
    """Tutorial chapter 13, sections 13.2 to 13.7, with the trained set (see the module docs)."""
    import json

    from handformer import inspect as hi
    from handformer.features import load_transcoder_set
    from handformer.features.stream import ActivationReader, parse_sites
    from handformer.pretrained import load_lm

    model, tok = load_lm("smollm2-135m-instruct")
    model.eval()
    n_layers = model.config.num_layers
    if not folder.is_dir():
        raise SystemExit(f"{folder}: no such folder; build the set with python "
                         "benchmarks/bench_features.py --only transcoders")
    trained_set = load_transcoder_set(folder, n_layers=n_layers)
    missing = [i for i, tc in enumerate(trained_set) if tc is None]
    if missing:
        raise SystemExit(f"{folder}: no transcoder for layers {missing} (the chapter's trained "
                         "set has one per layer)")
    first = trained_set[0]
    print(f"trained set {folder}: {n_layers} transcoders of {first.d_sae} features, "
          f"{first.activation} k={first.k}")
    summary = folder / "summary.json"
    if summary.is_file():
        data = json.loads(summary.read_text())
        evs = [m.get("explained_variance") for m in data.get("metrics", {}).values()]
        evs = sorted(v for v in evs if v is not None)
        if evs:
            print(f"trained on {data.get('tokens')} tokens; held-out explained variance "
                  f"{evs[0]:.2f} (min) {evs[len(evs) // 2]:.2f} (median) {evs[-1]:.2f} (max)")
    names: dict[str, object] = {"torch": torch, "hi": hi, "smol": model, "smol_tok": tok,
                                "paris": hi.to_single_token(tok, " Paris"),
                                "__name__": "tutorial"}
    out.mkdir(parents=True, exist_ok=True)
    here = Path.cwd()
    os.chdir(out)
    try:
        for line, code in chapter_blocks():
            training = "def fit_transcoder" in code
            if training:
                code = definitions_only(code)
            code = code.replace("max_feature_nodes=64", f"max_feature_nodes={max_nodes}")
            printed = io.StringIO()
            start = time.perf_counter()
            with contextlib.redirect_stdout(printed):
                exec(compile(code, f"tutorial.en.md, block at line {line}", "exec"), names)
                if training:  # the trained set in place of the chapter's tiny transcoders
                    names["transcoders"], names["LAYERS"] = trained_set, list(range(n_layers))
                    sites = parse_sites(model, "all", transcoder=True)
                    names["mlp_io"] = io_all = ActivationReader(model, sites).read(
                        names["fact_ids"])
                    evs = sorted(names["explained"](trained_set[i], *io_all[s.at])
                                 for i, s in enumerate(sites))
                    print(f"explained variance on the chapter's sentences: {evs[0]:.2f} (min) "
                          f"{evs[len(evs) // 2]:.2f} (median) {evs[-1]:.2f} (max)")
            print(f"--- tutorial.en.md block at line {line} ({time.perf_counter() - start:.1f} s)")
            print(printed.getvalue(), end="")
        graph = names["graph"]
        print("--- graph stages (s):", {k: round(v, 1) for k, v in graph.timings.items()})
        print(f"--- files in {out}: {sorted(p.name for p in out.iterdir())}")
    finally:
        os.chdir(here)
    if corpus_tokens:
        corpus_contexts(model, tok, trained_set, graph, list(names["features"])[:8],
                        corpus_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a causal LM source for load_lm")
    parser.add_argument("--features", type=int, default=64 if QUICK else 2048)
    parser.add_argument("--k", type=int, default=8 if QUICK else 32)
    parser.add_argument("--max-feature-nodes", type=int, default=None,
                        help="features kept (default 2048; 64 quick; 512 with --trained)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--transcoders", default=None, metavar="FOLDER",
                        help="time the graph with the transcoder set in FOLDER (a set "
                             "load_transcoder_set reads) instead of random ones")
    parser.add_argument("--trained", nargs="?", const="", default=None, metavar="FOLDER",
                        help="run tutorial chapter 13 on the trained transcoder set in FOLDER "
                             "(default ~/.cache/handformer/transcoders/smollm2-135m-instruct)")
    parser.add_argument("--out", default=None,
                        help="--trained: the folder for the chapter's files (default: a new "
                             "temporary folder)")
    parser.add_argument("--corpus-tokens", type=int, default=16384,
                        help="--trained: tokens of the en corpus to read the top features' "
                             "contexts in (0: none)")
    args = parser.parse_args()
    if args.trained is not None:
        from handformer.pretrained.gguf.shipped import cache_dir

        folder = (Path(args.trained).expanduser() if args.trained
                  else cache_dir() / "transcoders" / "smollm2-135m-instruct")
        nodes = args.max_feature_nodes if args.max_feature_nodes is not None else 512
        out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="chapter13-"))
        trained(folder, nodes, out, args.corpus_tokens)
        return
    if args.max_feature_nodes is None:
        args.max_feature_nodes = 64 if QUICK else 2048
    start = time.perf_counter()
    model, ids, name = load(args.model)
    load_s = time.perf_counter() - start
    torch.manual_seed(0)
    E = model.config.d_model
    if args.transcoders:
        from handformer.features import load_transcoder_set

        tcs = load_transcoder_set(args.transcoders, n_layers=model.config.num_layers)
        args.features, args.k = tcs[0].d_sae, tcs[0].k
        kind = f"trained ({args.transcoders})"
    else:
        tcs = [Transcoder(E, args.features, activation="topk", k=args.k)
               for _ in range(model.config.num_layers)]
        kind = "random"
    graph = attribution_graph(model, tcs, ids, max_feature_nodes=args.max_feature_nodes,
                              batch_size=args.batch_size)
    total = time.perf_counter() - start - load_s
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    pruned = graph.prune()
    data = {"machine": machine(), "model": name, "tokens": int(ids.shape[0]),
            "transcoders": kind, "features_per_layer": args.features, "k": args.k,
            "max_feature_nodes": args.max_feature_nodes, "batch_size": args.batch_size,
            "load_s": round(load_s, 2), "graph_s": round(total, 2),
            "stages_s": {k: round(v, 2) for k, v in graph.timings.items()},
            "peak_rss_mb": round(peak_mb), "nodes": int(graph.adjacency.shape[0]),
            "feature_nodes": graph.n_features, "logits": int(graph.logit_tokens.shape[0]),
            "pruned_nodes": int(pruned.node_mask.sum()),
            "pruned_edges": int(pruned.edge_mask.sum()),
            "replacement_score": round(graph.replacement_score, 4),
            "completeness_score": round(graph.completeness_score, 4)}
    stages = ", ".join(f"{k} {v:.1f} s" for k, v in graph.timings.items())
    markdown = (f"# Attribution graph benchmark\n\n{machine_line()}\n\n"
                f"{name}, {data['tokens']} tokens, {args.features} {kind} TopK-{args.k} "
                f"features per layer, {graph.n_features} feature nodes kept: **{total:.1f} s**"
                f" ({stages}), peak RSS {peak_mb:.0f} MB; replacement score "
                f"{graph.replacement_score:.3f}, completeness {graph.completeness_score:.3f}."
                "\n")
    print(markdown)
    write_results("graphs", data, markdown)


if __name__ == "__main__":
    main()
