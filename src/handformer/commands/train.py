"""``handformer train``: train a decoder-only model on a synthetic task or a text file.

Also the entry point of distributed runs: ``torchrun --nproc_per_node N -m handformer train``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

from handformer.commands.common import UsageError, check_attention_flags

NAME = "train"
HELP = ("Train a decoder-only CausalLM: copy/reverse/sort (synthetic sequence tasks written as "
        "'x>y', loss on y only) or lm --text FILE (character-level); resumable, torchrun-ready.")

EPILOG = """\
tasks (all decoder-only next-token prediction over characters):
  copy | reverse | sort   random sequences of --length symbols (0-9a-z, the first
                          --num-symbols), then '>', then the target; loss and exact-match
                          accuracy on the target only, on held-out sequences
  lm --text FILE          character-level language model; the last --val-fraction of the
                          text validates

examples:
  handformer train reverse --out runs/reverse
  handformer train lm --text book.txt --block-size 128 --d-model 128 --layers 4 --out runs/lm
  handformer train --resume runs/lm --steps 5000
  torchrun --nproc_per_node 2 -m handformer train reverse --out runs/ddp

The run folder holds train.json, config.json + model.safetensors (latest weights),
vocab.json, metrics.jsonl, checkpoints/, loss.png and attention.png.
"""

# (flag, config field, type, help) — defaults live in TrainConfig.
_OPTIONS: list[tuple[str, str, type, str]] = [
    ("--text", "text", str, "UTF-8 text file (task lm)"),
    ("--length", "length", int, "symbols per sequence, synthetic tasks (default 8)"),
    ("--num-symbols", "num_symbols", int, "alphabet size 2-36, synthetic tasks (default 10)"),
    ("--block-size", "block_size", int, "characters per window, lm (default 64)"),
    ("--val-fraction", "val_fraction", float, "validation share of the text, lm (default 0.1)"),
    ("--layers", "num_layers", int, "decoder layers (default 2)"),
    ("--d-model", "d_model", int, "model dim (default 64)"),
    ("--heads", "num_heads", int, "attention heads; must divide --d-model (default 4)"),
    ("--d-ff", "d_ff", int, "feed-forward dim (default 256)"),
    ("--dropout", "dropout", float, "dropout (default 0)"),
    ("--activation", "activation", str, "relu | gelu | gelu_tanh (default gelu)"),
    ("--positional", "positional", str, "learned | sinusoidal | rotary (default learned)"),
    ("--attention", "attention", str, "full | local | strided | linear (default full)"),
    ("--window-size", "window_size", int, "window of --attention local"),
    ("--stride", "stride", int, "stride of --attention strided"),
    ("--steps", "steps", int, "optimiser steps (default 600)"),
    ("--batch-size", "batch_size", int, "global batch: rows per step over all processes "
                                        "(default 64)"),
    ("--grad-accum", "grad_accum", int, "gradient-accumulation micro-steps (default 1)"),
    ("--lr", "lr", float, "peak learning rate (default 3e-3)"),
    ("--weight-decay", "weight_decay", float, "AdamW weight decay on matrices (default 0.01)"),
    ("--beta1", "beta1", float, "AdamW beta1 (default 0.9)"),
    ("--beta2", "beta2", float, "AdamW beta2 (default 0.98)"),
    ("--schedule", "schedule", str, "cosine (warm-up + cosine) | inverse_sqrt (the original "
                                    "Transformer's) | constant (default cosine)"),
    ("--warmup", "warmup", int, "warm-up steps (default 100)"),
    ("--min-lr-ratio", "min_lr_ratio", float, "final lr / peak lr of cosine (default 0.05)"),
    ("--clip-grad", "clip_grad", float, "max gradient norm, 0 = off (default 1.0)"),
    ("--label-smoothing", "label_smoothing", float, "label smoothing (default 0)"),
    ("--precision", "precision", str, "fp32 | bf16 | fp16 (CUDA only) (default fp32)"),
    ("--eval-every", "eval_every", int, "evaluate every N steps (default 100)"),
    ("--eval-size", "eval_size", int, "held-out sequences / validation windows (default "
                                      "1000)"),
    ("--log-every", "log_every", int, "write metrics every N steps (default 10)"),
    ("--ckpt-every", "ckpt_every", int, "checkpoint every N steps (default 200)"),
    ("--keep", "keep", int, "checkpoints kept (default 3)"),
    ("--seed", "seed", int, "seed of weights, data and held-out set (default 0)"),
    ("--device", "device", str, "auto | cpu | cuda (default auto)"),
    ("--threads", "threads", int, "CPU threads per process (default: 1 for models under 2M "
                                  "parameters, else torch's default)"),
    ("--stop-after", "stop_after", int, "stop with a checkpoint after N steps of this "
                                        "invocation (continue with --resume)"),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("task", nargs="?", metavar="TASK", help="copy | reverse | sort | lm")
    parser.add_argument("--out", type=Path, default=None,
                        help="run folder to create (default runs/TASK)")
    parser.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                        help="continue the run in RUN_DIR from its newest checkpoint")
    for flag, dest, kind, text in _OPTIONS:
        parser.add_argument(flag, dest=dest, type=kind, default=None, help=text)
    parser.add_argument("--no-progress", dest="progress", action="store_false", default=None,
                        help="no progress bar")


def _given(args: argparse.Namespace) -> dict[str, object]:
    from handformer.train.config import TrainConfig

    names = {f.name for f in fields(TrainConfig)} - {"task"}
    return {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}


def _resume_config(args: argparse.Namespace):  # noqa: ANN202 - TrainConfig
    import json

    from handformer.train.config import RESUME_OVERRIDABLE, TrainConfig
    from handformer.train.trainer import TRAIN_NAME, RunError

    run_dir: Path = args.resume
    if args.out is not None and args.out != run_dir:
        raise RunError("--resume continues a run in place; do not also give --out")
    path = run_dir / TRAIN_NAME
    if not path.is_file():
        raise RunError(f"{run_dir} is not a handformer run folder (no {TRAIN_NAME}); --resume "
                       "takes the folder a previous `handformer train` wrote")
    try:
        saved = TrainConfig.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as exc:
        raise RunError(f"{path} is corrupt ({exc})") from None
    if args.task is not None and args.task != saved.task:
        raise RunError(f"{run_dir} is a {saved.task!r} run, not {args.task!r}")
    for name, value in _given(args).items():
        if name in RESUME_OVERRIDABLE:
            setattr(saved, name, value)
        elif value != getattr(saved, name):
            raise RunError(f"--{name.replace('_', '-')} {value} differs from the run's "
                           f"{name}={getattr(saved, name)!r}; a resumed run keeps its options "
                           f"(only {', '.join(RESUME_OVERRIDABLE)} may change)")
    _check_resume_steps(run_dir, saved.steps)
    return saved


def _check_resume_steps(run_dir: Path, steps: int) -> None:
    """Refuse a ``--steps`` below the step the run has already reached (it would be ignored:
    a resumed run never goes back)."""
    from handformer.train.checkpoint import list_checkpoints

    found = list_checkpoints(run_dir)
    if found and steps < found[-1][0]:
        step, path = found[-1]
        raise UsageError(f"--steps {steps} is below the step the run has reached ({step}, its "
                         f"newest checkpoint {path.name}); a resumed run continues from there: "
                         f"give --steps {step + 1} or more, or leave --steps out")


def _check_pattern_options(given: dict[str, object]) -> None:
    """Refuse ``--window-size`` without ``--attention local`` and ``--stride`` without
    ``--attention strided``, in the command line's words (the rule ``viz`` and the server
    apply too). An unknown ``--attention`` is left to the config's own message."""
    from handformer.attention.registry import KIND_NAMES

    attention = given.get("attention", "full")
    if attention in KIND_NAMES:
        check_attention_flags(attention, window_size=given.get("window_size"),
                              stride=given.get("stride"))


def run(args: argparse.Namespace) -> int:
    from handformer.train.config import TrainConfig
    from handformer.train.trainer import train

    if args.resume is not None:
        config, run_dir, resume = _resume_config(args), args.resume, True
    else:
        if args.task is None:
            raise ValueError("give a TASK (copy, reverse, sort or lm) or --resume RUN_DIR")
        given = _given(args)
        _check_pattern_options(given)
        config = TrainConfig(task=args.task, **given)
        run_dir, resume = args.out or Path("runs") / args.task, False
    result = train(config, run_dir, resume=resume)
    import os

    if os.environ.get("RANK", "0") != "0":
        return 0
    if result.interrupted:
        sys.stderr.write(f"handformer train: interrupted at step {result.step}; checkpoint "
                         f"saved; continue with: handformer train --resume {run_dir}\n")
        return 130
    ev = result.final_eval
    detail = "" if ev is None else " · eval " + ", ".join(
        f"{k} {v:.4f}" for k, v in ev.items() if k not in ("split", "step", "elapsed_s"))
    if ev is not None and "elapsed_s" in ev:
        detail += f" · {ev['elapsed_s']:.1f} s of training"
    state = "finished" if result.finished else "stopped (resume with --resume)"
    print(f"{state} at step {result.step}{detail} · run folder {run_dir}")
    return 0
