"""Attribution graphs on CPU: one graph of a 16-token prompt on SmolLM2-135M.

Random transcoders of ``--features`` (default 2,048) features per layer, TopK with
``--k`` active per position (so the graph has ``30 × 16 × k`` active features to choose from),
one per MLP, in float32; ``--max-feature-nodes`` kept by influence (circuit-tracer's cap).
Reports the seconds of each stage (:attr:`AttributionGraph.timings`), the peak resident memory
of the process (``ru_maxrss``), the graph's size and its replacement / completeness scores
(random transcoders explain little: the scores say so; the timing is what this measures).

Usage: ``python benchmarks/bench_graphs.py [--model PATH]`` (default the shipped
SmolLM2-135M-Instruct .gguf). ``HANDFORMER_BENCH_QUICK=1``: a 4-layer random model of its
width, 64 features, one small graph.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import QUICK, machine, machine_line, write_results  # noqa: E402
from handformer import CausalLM, CausalLMConfig  # noqa: E402
from handformer.features import Transcoder, attribution_graph  # noqa: E402

PROMPT = ("The capital of France is Paris, and the capital of Italy is Rome. The capital of "
          "Spain is")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a causal LM source for load_lm")
    parser.add_argument("--features", type=int, default=64 if QUICK else 2048)
    parser.add_argument("--k", type=int, default=8 if QUICK else 32)
    parser.add_argument("--max-feature-nodes", type=int, default=64 if QUICK else 2048)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    start = time.perf_counter()
    model, ids, name = load(args.model)
    load_s = time.perf_counter() - start
    torch.manual_seed(0)
    E = model.config.d_model
    tcs = [Transcoder(E, args.features, activation="topk", k=args.k)
           for _ in range(model.config.num_layers)]
    graph = attribution_graph(model, tcs, ids, max_feature_nodes=args.max_feature_nodes,
                              batch_size=args.batch_size)
    total = time.perf_counter() - start - load_s
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    pruned = graph.prune()
    data = {"machine": machine(), "model": name, "tokens": int(ids.shape[0]),
            "features_per_layer": args.features, "k": args.k,
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
                f"{name}, {data['tokens']} tokens, {args.features} random TopK-{args.k} "
                f"features per layer, {graph.n_features} feature nodes kept: **{total:.1f} s**"
                f" ({stages}), peak RSS {peak_mb:.0f} MB; replacement score "
                f"{graph.replacement_score:.3f}, completeness {graph.completeness_score:.3f}."
                "\n")
    print(markdown)
    write_results("graphs", data, markdown)


if __name__ == "__main__":
    main()
