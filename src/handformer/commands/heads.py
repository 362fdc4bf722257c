"""``handformer heads``: which heads matter for the similarity of two sentences."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from handformer.commands.common import UsageError, add_device_argument, resolve_device

NAME = "heads"
HELP = ("Ablate every attention head in turn and show its effect on the cosine similarity "
        "of two sentence embeddings (heads.png and the five strongest heads).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("text_a", metavar="TEXT_A", help="first sentence")
    parser.add_argument("text_b", metavar="TEXT_B", help="second sentence")
    parser.add_argument("--model", metavar="DIR", default=None,
                        help="BERT-family checkpoint folder (default: bundled all-MiniLM-L6-v2)")
    parser.add_argument("--mode", choices=("zero", "mean"), default="zero",
                        help="replace a head's output by zeros or by its mean over both "
                             "sentences (default zero)")
    parser.add_argument("--out", metavar="DIR", default="heads",
                        help="folder for heads.png (default ./heads)")
    parser.add_argument("--top", type=int, default=5, help="heads to print (default 5)")
    add_device_argument(parser)


def run(args: argparse.Namespace) -> int:
    if args.top < 1:
        raise UsageError(f"--top must be at least 1, got {args.top}")
    if args.top > 2**31 - 1:
        raise UsageError(f"--top must be at most 2147483647 (2**31 - 1), got {args.top}")
    for name, text in (("TEXT_A", args.text_a), ("TEXT_B", args.text_b)):
        if not text.strip():
            raise UsageError(f"{name} is empty; give two sentences")

    from handformer.inspect.heads import pair_similarity_effects
    from handformer.pretrained import load_bert
    from handformer.viz.head_effects import plot_head_effects
    from handformer.viz.heatmap import save_figure

    device = resolve_device(args.device)
    model, tokenizer = load_bert(args.model)
    model.to(device)
    result = pair_similarity_effects(model, tokenizer, args.text_a, args.text_b,
                                     mode=args.mode)
    result = dataclasses.replace(result, effects=result.effects.cpu())  # for the plot
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fig = plot_head_effects(result.effects, top=args.top,
                            label=f"change in cosine ({args.mode} ablation)",
                            title=f"cosine {result.clean:.3f}: which heads move it")
    path = save_figure(fig, out / "heads.png")
    print(f"cosine similarity: {result.clean:.4f}  ({args.mode} ablation of each of "
          f"{result.effects.numel()} heads)")
    print(f"{'layer':>5} {'head':>4} {'change':>9}")
    for layer, head, change in result.top(args.top):
        print(f"{layer:>5} {head:>4} {change:>+9.4f}")
    print(f"wrote {path}")
    return 0
