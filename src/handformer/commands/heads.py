"""``handformer heads``: which heads matter.

Three metrics, each measured with every head ablated in turn:

* ``cosine`` (a BERT-family encoder, the default model): the cosine similarity of the
  embeddings of TEXT_A and TEXT_B;
* ``logprob`` (a causal LM: a folder ``load_lm`` reads, a ``.gguf`` file or a shipped name):
  the model's log-probability of TEXT_B right after TEXT_A;
* ``logit-diff`` (a causal LM): ``logit(--answer) - logit(--wrong)`` after the prompt TEXT_A.

Without ``--metric``: ``logprob`` for a causal LM, ``cosine`` for an encoder.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from handformer.commands.common import UsageError, add_device_argument, note, resolve_device

NAME = "heads"
HELP = ("Ablate every attention head in turn and show its effect (heads.png and the five "
        "strongest heads): on the cosine similarity of two sentence embeddings, on a causal "
        "LM's log-probability of TEXT_B after TEXT_A, or with --metric logit-diff on "
        "logit(--answer) - logit(--wrong) after a prompt.")
METRICS = ("cosine", "logprob", "logit-diff")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("text_a", metavar="TEXT_A",
                        help="first sentence (with --metric logit-diff: the prompt)")
    parser.add_argument("text_b", metavar="TEXT_B", nargs="?", default=None,
                        help="second sentence (cosine), or what follows TEXT_A (logprob)")
    parser.add_argument("--model", metavar="MODEL", default=None,
                        help="BERT-family checkpoint folder (default: bundled "
                             "all-MiniLM-L6-v2), or a causal LM folder, .gguf file or "
                             "shipped model name")
    parser.add_argument("--metric", choices=METRICS, default=None,
                        help="cosine (two sentences, an encoder), logprob (a causal LM: "
                             "log p(TEXT_B | TEXT_A)) or logit-diff (a causal LM, a prompt, "
                             "--answer and --wrong); default: logprob for a causal LM, else cosine")
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


def _model_name(folder: str | None) -> str:
    return "all-MiniLM-L6-v2" if folder is None else (Path(folder).resolve().name or folder)


def _unknown_note(tokenizer: object, args: argparse.Namespace, *, encoder: bool) -> None:
    """One ``note:`` line when the model does not read the texts' script."""
    from handformer.tokenizers.labels import (
        ENCODER_ADVICE,
        LM_ADVICE,
        texts_unknown_notice,
    )

    texts = [t for t in (args.text_a, args.text_b) if t is not None]
    unknown = texts_unknown_notice(tokenizer, texts, model=_model_name(args.model),
                                   advice=ENCODER_ADVICE if encoder else LM_ADVICE,
                                   what="TEXT_A and TEXT_B" if len(texts) > 1 else "the prompt")
    if unknown:
        note(unknown)


def _metric(args: argparse.Namespace) -> str:
    """``--metric``, or the one the model and ``--answer`` imply."""
    from handformer.commands.common import is_causal_model

    causal = is_causal_model(args.model, "heads")
    metric = args.metric or ("logprob" if causal else "cosine")
    if metric == "cosine" and causal:
        raise UsageError(f"--metric cosine compares sentence embeddings of an encoder; "
                         f"{args.model} is a causal LM: use --metric logprob or logit-diff")
    if metric != "cosine" and not causal:
        raise UsageError(f"--metric {metric} needs a causal LM --model (a folder, a .gguf "
                         "file or a shipped name such as smollm2-135m-instruct)")
    return metric


def _check(args: argparse.Namespace) -> None:
    if args.top < 1:
        raise UsageError(f"--top must be at least 1, got {args.top}")
    if args.metric in ("cosine", "logprob"):
        if args.text_b is None:
            raise UsageError(f"--metric {args.metric} needs two "
                             + ("sentences" if args.metric == "cosine" else "texts")
                             + " TEXT_A TEXT_B")
        if args.answer is not None or args.wrong is not None:
            raise UsageError("--answer and --wrong go with --metric logit-diff")
        texts = (("TEXT_A", args.text_a), ("TEXT_B", args.text_b))
        if args.metric == "logprob" and (args.answer is not None or args.wrong is not None):
            raise UsageError("--answer and --wrong go with --metric logit-diff")
    else:
        if args.answer is None or args.wrong is None:
            raise UsageError("--metric logit-diff needs --answer TOKEN and --wrong TOKEN")
        if args.text_b is not None:
            raise UsageError("--metric logit-diff takes one prompt, got a second text "
                             f"{args.text_b!r}")
        texts = (("the prompt", args.text_a),)
    for name, text in texts:
        if not text.strip():
            raise UsageError(f"{name} is empty; give two sentences" if args.metric == "cosine"
                             else f"{name} is empty")


def run(args: argparse.Namespace) -> int:
    if args.top < 1:
        raise UsageError(f"--top must be at least 1, got {args.top}")
    if args.top > 2**31 - 1:
        raise UsageError(f"--top must be at most 2147483647 (2**31 - 1), got {args.top}")
    if args.metric is not None:
        _check(args)  # the flags first, before the model's config is read
    args.metric = _metric(args)
    _check(args)
    from handformer.viz.head_effects import plot_head_effects
    from handformer.viz.heatmap import save_figure

    device = resolve_device(args.device)
    if args.metric == "cosine":
        from handformer.inspect.heads import pair_similarity_effects
        from handformer.pretrained import load_bert

        model, tokenizer = load_bert(args.model)
        model.to(device)
        _unknown_note(tokenizer, args, encoder=True)
        result = pair_similarity_effects(model, tokenizer, args.text_a, args.text_b,
                                         mode=args.mode)
        label, what = f"change in cosine ({args.mode} ablation)", "cosine similarity"
        title = f"cosine {result.clean:.3f}: which heads move it"
    elif args.metric == "logprob":
        from handformer.commands.generate import load_model_and_tokenizer
        from handformer.inspect.heads import continuation_effects

        model, tokenizer = load_model_and_tokenizer(args.model, command="heads")
        model.to(device)
        _unknown_note(tokenizer, args, encoder=False)
        result = continuation_effects(model, tokenizer, args.text_a, args.text_b,
                                      mode=args.mode)
        label = f"change in log p(TEXT_B | TEXT_A) ({args.mode} ablation)"
        what = "log p(TEXT_B | TEXT_A)"
        title = f"log p {result.clean:.3f}: which heads move it"
    else:
        from handformer.commands.generate import load_model_and_tokenizer
        from handformer.inspect.heads import logit_diff_effects

        model, tokenizer = load_model_and_tokenizer(args.model, command="heads")
        model.to(device)
        _unknown_note(tokenizer, args, encoder=False)
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
