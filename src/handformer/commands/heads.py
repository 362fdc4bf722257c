"""``handformer heads``: which heads matter, for the similarity of two sentences (BERT) or for
a causal LM's logit difference between two next tokens (``--metric logit-diff``)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from handformer.commands.common import UsageError, add_device_argument, resolve_device

NAME = "heads"
HELP = ("Ablate every attention head in turn and show its effect (heads.png and the five "
        "strongest heads): on the cosine similarity of two sentence embeddings, or with "
        "--metric logit-diff on a causal LM's logit(--answer) - logit(--wrong) after a prompt.")
METRICS = ("cosine", "logit-diff")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("text_a", metavar="TEXT_A",
                        help="first sentence (with --metric logit-diff: the prompt)")
    parser.add_argument("text_b", metavar="TEXT_B", nargs="?", default=None,
                        help="second sentence (cosine only)")
    parser.add_argument("--model", metavar="DIR", default=None,
                        help="checkpoint folder: BERT family for cosine (default: bundled "
                             "all-MiniLM-L6-v2), a causal LM for logit-diff")
    parser.add_argument("--metric", choices=METRICS, default="cosine",
                        help="cosine (two sentences, BERT) or logit-diff (a prompt, a causal "
                             "LM, --answer and --wrong)")
    parser.add_argument("--answer", metavar="TOKEN", default=None,
                        help="with --metric logit-diff: the expected next token, e.g. ' Mary'")
    parser.add_argument("--wrong", metavar="TOKEN", default=None,
                        help="with --metric logit-diff: the competing token, e.g. ' John'")
    parser.add_argument("--mode", choices=("zero", "mean"), default="zero",
                        help="replace a head's output by zeros or by its mean over the "
                             "inputs (default zero)")
    parser.add_argument("--out", metavar="DIR", default="heads",
                        help="folder for heads.png (default ./heads)")
    parser.add_argument("--top", type=int, default=5, help="heads to print (default 5)")
    add_device_argument(parser)


def _check(args: argparse.Namespace) -> None:
    if args.top < 1:
        raise UsageError(f"--top must be at least 1, got {args.top}")
    if args.metric == "cosine":
        if args.text_b is None:
            raise UsageError("--metric cosine needs two sentences TEXT_A TEXT_B")
        if args.answer is not None or args.wrong is not None:
            raise UsageError("--answer and --wrong go with --metric logit-diff")
        texts = (("TEXT_A", args.text_a), ("TEXT_B", args.text_b))
    else:
        if args.answer is None or args.wrong is None:
            raise UsageError("--metric logit-diff needs --answer TOKEN and --wrong TOKEN")
        if args.text_b is not None:
            raise UsageError("--metric logit-diff takes one prompt, got a second text "
                             f"{args.text_b!r}")
        if args.model is None:
            raise UsageError("--metric logit-diff needs --model DIR (a causal LM folder)")
        texts = (("the prompt", args.text_a),)
    for name, text in texts:
        if not text.strip():
            raise UsageError(f"{name} is empty; give two sentences" if args.metric == "cosine"
                             else f"{name} is empty")


def _load_causal_lm(path: str) -> tuple[object, object]:
    """A causal LM and its tokenizer: ``load_lm`` (every family, GGUF, shipped names) where
    the package has it, else a GPT-2 folder."""
    import importlib.util

    if importlib.util.find_spec("handformer.pretrained.lm") is not None:
        from handformer.pretrained.lm import load_lm

        model, tokenizer = load_lm(path)
    else:
        from handformer.pretrained.gpt2 import load_gpt2

        model, tokenizer = load_gpt2(path)
    if tokenizer is None:
        raise UsageError(f"{path} has no tokenizer; --metric logit-diff needs one")
    return model, tokenizer


def run(args: argparse.Namespace) -> int:
    _check(args)
    from handformer.viz.head_effects import plot_head_effects
    from handformer.viz.heatmap import save_figure

    device = resolve_device(args.device)
    if args.metric == "cosine":
        from handformer.inspect.heads import pair_similarity_effects
        from handformer.pretrained import load_bert

        model, tokenizer = load_bert(args.model)
        model.to(device)
        result = pair_similarity_effects(model, tokenizer, args.text_a, args.text_b,
                                         mode=args.mode)
        label, what = f"change in cosine ({args.mode} ablation)", "cosine similarity"
        title = f"cosine {result.clean:.3f}: which heads move it"
    else:
        from handformer.inspect.heads import logit_diff_effects

        model, tokenizer = _load_causal_lm(args.model)
        model.to(device)
        try:
            result = logit_diff_effects(model, tokenizer, args.text_a, args.answer,
                                        args.wrong, mode=args.mode)
        except ValueError as exc:  # an answer that is not one token
            raise UsageError(str(exc)) from exc
        label = f"change in logit difference ({args.mode} ablation)"
        what = f"logit({args.answer!r}) - logit({args.wrong!r})"
        title = f"{what} = {result.clean:.2f}: which heads move it"
    result = dataclasses.replace(result, effects=result.effects.cpu())  # for the plot
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fig = plot_head_effects(result.effects, top=args.top, label=label, title=title)
    path = save_figure(fig, out / "heads.png")
    print(f"{what}: {result.clean:.4f}  ({args.mode} ablation of each of "
          f"{result.effects.numel()} heads)")
    print(f"{'layer':>5} {'head':>4} {'change':>9}")
    for layer, head, change in result.top(args.top):
        print(f"{layer:>5} {head:>4} {change:>+9.4f}")
    print(f"wrote {path}")
    return 0
