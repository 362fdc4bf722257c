"""``handformer embed``: sentence embeddings and their cosine similarities.

A text longer than the model's limit (512 tokens for all-MiniLM-L6-v2) is cut to it, with a
one-line ``note:`` on stderr (the tokenizer's warning, shown by the CLI as a note).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from handformer.commands.common import UsageError, add_device_argument, note, resolve_device

NAME = "embed"
HELP = ("Embed sentences with a BERT-family model (default: bundled all-MiniLM-L6-v2) and "
        "print their cosine-similarity matrix.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("sentences", nargs="+", metavar="SENTENCE", help="texts to embed")
    parser.add_argument("--model", metavar="DIR", default=None,
                        help="checkpoint folder (config.json, model.safetensors, tokenizer)")
    parser.add_argument("--json", action="store_true",
                        help="print {sentence, embedding} objects as JSON instead of the table")
    parser.add_argument("--batch-size", type=int, default=32, help="texts per forward pass")
    add_device_argument(parser)


def similarity_table(sentences: list[str], sims: list[list[float]], *, width: int = 24
                     ) -> str:
    """An aligned text table: one row and one column per sentence (labels cut to ``width``)."""
    labels = [s if len(s) <= width else s[: width - 1] + "…" for s in sentences]
    w = max(len(label) for label in labels)
    index = [f"[{i}]" for i in range(len(sentences))]
    col = max(6, max(len(x) for x in index))
    lines = [" " * (w + len(index[-1]) + 2) + " ".join(f"{x:>{col}}" for x in index)]
    for i, (label, row) in enumerate(zip(labels, sims, strict=True)):
        lines.append(f"{index[i]:>{len(index[-1])}} {label:<{w}} "
                     + " ".join(f"{v:>{col}.3f}" for v in row))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import torch.nn.functional as F

    from handformer.pretrained import embed, load_bert
    from handformer.pretrained.lm import is_causal_source

    if args.model is not None and is_causal_source(args.model):
        raise UsageError(f"--model {args.model} is a causal language model; embed makes "
                         "sentence embeddings with a BERT-family encoder. Look at its "
                         "attention with `handformer viz TEXT --model ...` or continue text "
                         "with `handformer generate --model ... --prompt TEXT`")
    from handformer.checks import MAX_INT

    if args.batch_size > MAX_INT:  # before the model load and its notes
        raise UsageError(f"--batch-size must be at most {MAX_INT} (2**31 - 1), got "
                         f"{args.batch_size}")
    device = resolve_device(args.device)
    model, tokenizer = load_bert(args.model)
    model.to(device)
    from handformer.tokenizers.labels import ENCODER_ADVICE, texts_unknown_notice

    name = ("all-MiniLM-L6-v2" if args.model is None
            else Path(args.model).resolve().name or args.model)
    unknown = texts_unknown_notice(tokenizer, args.sentences, model=name, what="the sentences",
                                   advice=ENCODER_ADVICE)
    if unknown:
        note(unknown)
    vectors = embed(args.sentences, model=model, tokenizer=tokenizer,
                    batch_size=args.batch_size).cpu()  # (N, E)
    if args.json:
        print(json.dumps([{"sentence": s, "embedding": [round(x, 7) for x in v]}
                          for s, v in zip(args.sentences, vectors.tolist(), strict=True)]))
        return 0
    unit = F.normalize(vectors, dim=-1)
    print(similarity_table(args.sentences, (unit @ unit.T).tolist()))
    return 0
