"""``handformer generate``: continue a prompt with a causal language model, streaming tokens.

The model folder is either a GPT-2-family checkpoint (``config.json`` with
``model_type: gpt2`` + ``model.safetensors``, loaded by ``load_gpt2``) or a folder written by
``CausalLM.save_pretrained`` (e.g. a ``handformer train`` run). The tokenizer is looked up in
the same folder, in this order:

1. ``tokenizer.json`` -- any ``tokenizers`` tokenizer (GPT-2's byte-level BPE, ...);
2. ``vocab.json`` with ``"kind": "char"`` -- the character vocabulary the trainer saves.

Greedy decoding by default; ``--temperature``, ``--top-k`` or ``--top-p`` switch to sampling,
seeded by ``--seed`` (same seed, same text on one device). Without ``--max-new-tokens`` it
makes up to 50 tokens, fewer where the model's context ends (with a note on stderr).
``--device`` picks where the model runs (see :mod:`handformer.commands.common`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from handformer.commands.common import (
    UsageError,
    add_device_argument,
    check_sampling_flags,
    note,
    resolve_device,
)

NAME = "generate"
HELP = "Continue a prompt with a GPT-2 or handformer CausalLM folder, streaming the tokens."


DEFAULT_NEW_TOKENS = 50  # without --max-new-tokens: this many, or fewer where the context ends


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="DIR", required=True,
                        help="GPT-2 folder or CausalLM.save_pretrained folder")
    parser.add_argument("--prompt", metavar="TEXT", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                        help=f"tokens to generate (default: {DEFAULT_NEW_TOKENS}, or as many as "
                             "fit in the model's context, with a note)")
    parser.add_argument("--temperature", type=float, default=None, metavar="T",
                        help="sample with this temperature (finite, > 0); greedy without "
                             "--temperature, --top-k and --top-p")
    parser.add_argument("--top-k", type=int, default=None, metavar="K",
                        help="sample among the K most likely tokens")
    parser.add_argument("--top-p", type=float, default=None, metavar="P",
                        help="nucleus sampling threshold in (0, 1]")
    parser.add_argument("--seed", type=int, default=0, metavar="S",
                        help="random seed for sampling, 0 to 2**63 - 1 (default 0)")
    parser.add_argument("--no-cache", action="store_true",
                        help="recompute the whole sequence at every step (slow; for checks)")
    add_device_argument(parser)


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
        from handformer.pretrained.folders import hub_hint

        hint = "" if folder.exists() else hub_hint(folder)  # "gpt2": say there is no hub
        raise FileNotFoundError(f"no config.json in {folder}: --model takes a GPT-2 or a "
                                f"CausalLM folder{hint}")
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
    only; the end-of-text token is not printed). ``count`` is the number of tokens seen."""

    def __init__(self, tokenizer: object, prompt: str, eos: int | None, out: object) -> None:
        self.tokenizer, self.prompt, self.eos, self.out = tokenizer, prompt, eos, out
        self.ids: list[int] = []
        self.count = 0
        self.printed = -1  # -1: the prompt is not printed yet

    def _write(self, text: str) -> None:
        if self.printed < 0:
            self.out.write(self.prompt)
            self.printed = 0
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)

    def __call__(self, token: object) -> None:
        self.count += 1
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


def _check_flags(args: argparse.Namespace) -> None:
    """Refuse bad numbers before the (slow) model load (the server's rule for the same
    options: :func:`~handformer.commands.common.check_sampling_flags`)."""
    check_sampling_flags(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                         seed=args.seed)
    if args.max_new_tokens is not None and args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens must be an integer >= 0, got {args.max_new_tokens}")


def new_token_count(requested: int | None, prompt_len: int, max_len: int) -> tuple[int, bool]:
    """How many tokens to generate after a prompt of ``prompt_len`` tokens.

    Args:
        requested: ``--max-new-tokens`` (None: :data:`DEFAULT_NEW_TOKENS`, or fewer where the
            context ``max_len`` ends).
        prompt_len: tokens in the prompt.
        max_len: the model's context.

    Returns:
        ``(n, cut)``: the count, and whether the context cut the default short.

    Raises:
        UsageError: for a prompt longer than the context, or an explicit ``requested`` that
            does not fit (the message says how many do).
    """
    room = max_len - prompt_len
    if room < 0:
        raise UsageError(f"the prompt has {prompt_len} tokens, longer than the context "
                         f"max_len={max_len} of this model; shorten the prompt")
    if requested is None:
        return min(DEFAULT_NEW_TOKENS, room), room < DEFAULT_NEW_TOKENS
    if requested > room:
        raise UsageError(f"the prompt ({prompt_len} tokens) + --max-new-tokens {requested} = "
                         f"{prompt_len + requested} exceeds the context max_len={max_len}; "
                         f"give --max-new-tokens {room} or less, or leave it out to generate "
                         "what fits")
    return requested, False


def run(args: argparse.Namespace) -> int:
    import torch

    _check_flags(args)
    device = resolve_device(args.device)
    model, tokenizer = load_model_and_tokenizer(args.model)
    model.to(device)
    ids = tokenizer.encode(args.prompt)
    if not ids:
        raise UsageError("the prompt is empty after tokenization; give some text")
    max_len = model.config.max_len
    n, cut = new_token_count(args.max_new_tokens, len(ids), max_len)
    do_sample = any(v is not None for v in (args.temperature, args.top_k, args.top_p))
    eos = getattr(tokenizer, "eos_token_id", None)
    stream = _TextStream(tokenizer, args.prompt, eos, sys.stdout)
    model.generate(
        torch.tensor([ids], device=device), max_new_tokens=n, do_sample=do_sample,
        temperature=1.0 if args.temperature is None else args.temperature, top_k=args.top_k,
        top_p=args.top_p, eos_token_id=eos,
        generator=torch.Generator(device=device).manual_seed(args.seed),
        use_cache=not args.no_cache, streamer=stream,
    )
    stream.finish()
    if cut and n == 0:
        note(f"the prompt ({len(ids)} tokens) fills the model's context of {max_len} tokens; "
             "nothing was generated")
    elif cut and stream.count == n:  # not stopped earlier by the end-of-text token
        note(f"stopped at the model's context limit: {len(ids)} prompt + {n} new = {max_len} "
             f"tokens (without --max-new-tokens, generate makes up to {DEFAULT_NEW_TOKENS} "
             "tokens, as many as fit)")
    return 0
