"""``handformer generate``: continue a prompt with a causal language model, streaming tokens.

The model folder is either a GPT-2-family checkpoint (``config.json`` with
``model_type: gpt2`` + ``model.safetensors``, loaded by ``load_gpt2``) or a folder written by
``CausalLM.save_pretrained`` (e.g. a ``handformer train`` run). The tokenizer is looked up in
the same folder, in this order:

1. ``tokenizer.json`` -- any ``tokenizers`` tokenizer (GPT-2's byte-level BPE, ...);
2. ``vocab.json`` with ``"kind": "char"`` -- the character vocabulary the trainer saves.

Greedy decoding by default; ``--temperature``, ``--top-k`` or ``--top-p`` switch to sampling,
seeded by ``--seed`` (same seed, same text).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

NAME = "generate"
HELP = "Continue a prompt with a GPT-2 or handformer CausalLM folder, streaming the tokens."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="DIR", required=True,
                        help="GPT-2 folder or CausalLM.save_pretrained folder")
    parser.add_argument("--prompt", metavar="TEXT", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=50, metavar="N",
                        help="tokens to generate (default 50)")
    parser.add_argument("--temperature", type=float, default=None, metavar="T",
                        help="sample with this temperature (> 0)")
    parser.add_argument("--top-k", type=int, default=None, metavar="K",
                        help="sample among the K most likely tokens")
    parser.add_argument("--top-p", type=float, default=None, metavar="P",
                        help="nucleus sampling threshold in (0, 1]")
    parser.add_argument("--seed", type=int, default=0, metavar="S",
                        help="random seed for sampling (default 0)")
    parser.add_argument("--no-cache", action="store_true",
                        help="recompute the whole sequence at every step (slow; for checks)")


def load_model_and_tokenizer(folder: str | Path) -> tuple[object, object]:
    """The model and tokenizer of a generation folder (see the module docstring).

    Raises:
        FileNotFoundError: for a missing folder or config.
        ValueError: for an unknown model type or a folder without a tokenizer.
    """
    from handformer.models.causal_lm import MODEL_TYPE, CausalLM
    from handformer.pretrained.gpt2 import load_gpt2
    from handformer.pretrained.text_tokenizer import TextTokenizer

    folder = Path(folder)
    config = folder / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"no config.json in {folder}: --model takes a GPT-2 or a "
                                "CausalLM folder")
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (ValueError, AttributeError) as exc:
        raise ValueError(f"{config}: not a JSON object ({exc})") from exc
    if model_type == "gpt2":
        model, tokenizer = load_gpt2(folder)
    elif model_type == MODEL_TYPE:
        model, tokenizer = CausalLM.from_pretrained(folder), TextTokenizer.from_dir(folder)
    else:
        raise ValueError(f"{config}: model_type {model_type!r} cannot generate; expected "
                         f"'gpt2' or {MODEL_TYPE!r}")
    if tokenizer is None and (folder / "vocab.json").is_file():
        from handformer.train.data import CharVocab

        tokenizer = CharVocab.load(folder / "vocab.json")
    if tokenizer is None:
        raise ValueError(f"{folder} has no tokenizer: add tokenizer.json (tokenizers library) "
                         "or a character vocab.json")
    return model, tokenizer


class _TextStream:
    """Print the prompt, then the text of the generated ids as it grows (whole characters
    only; the end-of-text token is not printed)."""

    def __init__(self, tokenizer: object, prompt: str, eos: int | None, out: object) -> None:
        self.tokenizer, self.prompt, self.eos, self.out = tokenizer, prompt, eos, out
        self.ids: list[int] = []
        self.printed = -1  # -1: the prompt is not printed yet

    def _write(self, text: str) -> None:
        if self.printed < 0:
            self.out.write(self.prompt)
            self.printed = 0
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)

    def __call__(self, token: object) -> None:
        if int(token[0]) == self.eos:
            return
        self.ids.append(int(token[0]))
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):  # else an incomplete UTF-8 sequence: wait
            self._write(text)

    def finish(self) -> None:
        self._write(self.tokenizer.decode(self.ids) if self.ids else "")
        self.out.write("\n")
        self.out.flush()


def run(args: argparse.Namespace) -> int:
    import torch

    from handformer.commands import UsageError

    if not -(2**63) <= args.seed < 2**64:  # torch's seed range
        raise UsageError(f"--seed must be in [-2**63, 2**64), got {args.seed}")
    model, tokenizer = load_model_and_tokenizer(args.model)
    ids = tokenizer.encode(args.prompt)
    if not ids:
        raise UsageError("the prompt is empty after tokenization; give some text")
    do_sample = any(v is not None for v in (args.temperature, args.top_k, args.top_p))
    eos = getattr(tokenizer, "eos_token_id", None)
    stream = _TextStream(tokenizer, args.prompt, eos, sys.stdout)
    model.generate(
        torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=do_sample,
        temperature=1.0 if args.temperature is None else args.temperature, top_k=args.top_k,
        top_p=args.top_p, eos_token_id=eos, generator=torch.Generator().manual_seed(args.seed),
        use_cache=not args.no_cache, streamer=stream,
    )
    stream.finish()
    return 0
