"""``handformer heads``: which heads matter.

With a BERT-family encoder (the default): for the cosine similarity of two sentence
embeddings. With a causal LM (``--model`` a folder ``load_lm`` reads, a ``.gguf`` file or a
shipped name): for the model's log-probability of TEXT_B right after TEXT_A.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from handformer.commands.common import UsageError, add_device_argument, note, resolve_device

NAME = "heads"
HELP = ("Ablate every attention head in turn and show its effect on the cosine similarity "
        "of two sentence embeddings, or (causal LMs) on the log-probability of TEXT_B after "
        "TEXT_A (heads.png and the five strongest heads).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("text_a", metavar="TEXT_A", help="first sentence (causal LM: the prompt)")
    parser.add_argument("text_b", metavar="TEXT_B",
                        help="second sentence (causal LM: what follows the prompt)")
    parser.add_argument("--model", metavar="MODEL", default=None,
                        help="BERT-family checkpoint folder (default: bundled "
                             "all-MiniLM-L6-v2), or a causal LM folder, .gguf file or "
                             "shipped model name")
    parser.add_argument("--mode", choices=("zero", "mean"), default="zero",
                        help="replace a head's output by zeros or by its mean over both "
                             "sentences (default zero)")
    parser.add_argument("--out", metavar="DIR", default="heads",
                        help="folder for heads.png (default ./heads)")
    parser.add_argument("--top", type=int, default=5, help="heads to print (default 5)")
    add_device_argument(parser)


def _model_name(folder: str | None) -> str:
    return "all-MiniLM-L6-v2" if folder is None else (Path(folder).resolve().name or folder)


def _unknown_note(tokenizer: object, args: argparse.Namespace, advice: str) -> None:
    """One ``note:`` line when the model does not read the texts' script."""
    from handformer.pretrained.token_labels import texts_unknown_notice

    unknown = texts_unknown_notice(tokenizer, [args.text_a, args.text_b], advice=advice,
                                   what="TEXT_A and TEXT_B", model=_model_name(args.model))
    if unknown:
        note(unknown)


def run(args: argparse.Namespace) -> int:
    if args.top < 1:
        raise UsageError(f"--top must be at least 1, got {args.top}")
    for name, text in (("TEXT_A", args.text_a), ("TEXT_B", args.text_b)):
        if not text.strip():
            raise UsageError(f"{name} is empty; give two sentences")

    from handformer.commands.common import is_causal_model
    from handformer.inspect.heads import continuation_effects, pair_similarity_effects
    from handformer.pretrained import load_bert
    from handformer.pretrained.token_labels import ENCODER_ADVICE, LM_ADVICE
    from handformer.viz.head_effects import plot_head_effects
    from handformer.viz.heatmap import save_figure

    causal = is_causal_model(args.model, "heads")
    device = resolve_device(args.device)
    if causal:
        from handformer.commands.generate import load_model_and_tokenizer

        model, tokenizer = load_model_and_tokenizer(args.model, command="heads")
        model.to(device)
        _unknown_note(tokenizer, args, LM_ADVICE)
        result = continuation_effects(model, tokenizer, args.text_a, args.text_b,
                                      mode=args.mode)
        label, what, short = ("change in log p(TEXT_B | TEXT_A)", "log p(TEXT_B | TEXT_A)",
                              "log p")
    else:
        model, tokenizer = load_bert(args.model)
        model.to(device)
        _unknown_note(tokenizer, args, ENCODER_ADVICE)
        result = pair_similarity_effects(model, tokenizer, args.text_a, args.text_b,
                                         mode=args.mode)
        label, what, short = "change in cosine", "cosine similarity", "cosine"
    result = dataclasses.replace(result, effects=result.effects.cpu())  # for the plot
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fig = plot_head_effects(result.effects, top=args.top, label=f"{label} ({args.mode} "
                                                                  "ablation)",
                            title=f"{short} {result.clean:.3f}: which heads move it")
    path = save_figure(fig, out / "heads.png")
    print(f"{what}: {result.clean:.4f}  ({args.mode} ablation of each of "
          f"{result.effects.numel()} heads)")
    print(f"{'layer':>5} {'head':>4} {'change':>9}")
    for layer, head, change in result.top(args.top):
        print(f"{layer:>5} {head:>4} {change:>+9.4f}")
    print(f"wrote {path}")
    return 0
