"""``handformer generate``: continue a prompt with a causal language model, streaming tokens.

``--model`` is anything :func:`handformer.pretrained.load_lm` reads: a checkpoint folder of a
causal LM family (``config.json`` with ``model_type`` ``gpt2``, ``llama``, ``mistral``,
``qwen2``, ``qwen3``, ``gemma2``, ``gemma3_text``, ``gemma3`` + safetensors weights), a folder
written by ``CausalLM.save_pretrained`` (e.g. a ``handformer train`` run), a ``.gguf`` file or
a shipped model's name. The tokenizer comes with it: ``tokenizer.json`` (with the folder's
special tokens), GPT-2's ``vocab.json`` + ``merges.txt``, the GGUF file's own, or the
character vocabulary ``vocab.json`` the trainer saves.

Greedy decoding by default; ``--temperature``, ``--top-k`` or ``--top-p`` switch to sampling,
seeded by ``--seed`` (same seed, same text on one device). Without ``--max-new-tokens`` it
makes up to 50 tokens, fewer where the model's context ends (with a note on stderr).
``--stop TEXT`` (repeatable) ends the text before TEXT; ``--repetition-penalty`` lowers the
scores of tokens already present (transformers' rule); ``--dtype bfloat16`` halves the
weights' memory; ``--threads`` sets PyTorch's CPU threads. ``--device`` picks where the model
runs (see :mod:`handformer.commands.common`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from handformer.commands.common import (
    UsageError,
    add_decoding_options,
    add_device_argument,
    apply_decoding_options,
    check_sampling_flags,
    note,
    resolve_device,
)
from handformer.commands.steering import add_steering_options, check_steering_flags, steering

NAME = "generate"
HELP = ("Continue a prompt with a causal LM (GPT-2, Llama, Mistral, Qwen, Gemma, a GGUF file "
        "or a handformer train run), streaming the tokens.")


DEFAULT_NEW_TOKENS = 50  # without --max-new-tokens: this many, or fewer where the context ends
CHAT_NEW_TOKENS = 256  # a reply's default limit with --chat (it usually ends at its end token)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="MODEL", required=True,
                        help="causal LM folder (GPT-2, Llama, Mistral, Qwen2/3, Gemma 2/3, a "
                             "handformer train run), a .gguf file or a shipped model name")
    text = parser.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", metavar="TEXT", help="text to continue")
    text.add_argument("--chat", metavar="TEXT",
                      help="a message to an instruct model: rendered with its chat template, "
                           "the reply streamed until the end of its turn")
    from handformer.commands.chat import add_chat_options

    add_chat_options(parser)
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
    add_decoding_options(parser)
    parser.add_argument("--no-cache", action="store_true",
                        help="recompute the whole sequence at every step (slow; for checks)")
    add_device_argument(parser)
    parser.add_argument("--quantize", choices=["int8", "int4"], default=None,
                        help="int8 or 4-bit weights for the linear layers (CPU; see docs/llms.md)")
    add_steering_options(parser)


def load_model_and_tokenizer(source: str | Path, *, command: str = "generate",
                             device: object = "cpu", dtype: object = None,
                             quantize: str | None = None
                             ) -> tuple[object, object]:
    """The model and tokenizer of ``--model`` (see the module docstring), through
    :func:`handformer.pretrained.load_lm`.

    Raises:
        FileNotFoundError: for nothing at ``source``, a folder without config or weights.
        UsageError: for a ``model_type`` that is not a causal LM (naming what is accepted).
        ValueError: for a folder without a tokenizer.
    """
    from handformer.commands.common import causal_choices, is_causal_model
    from handformer.pretrained.lm import is_causal_source, load_lm_with_tokenizer

    path = Path(source)
    if not path.exists() and not is_causal_source(str(source)):
        from handformer.pretrained.folders import hub_hint

        raise FileNotFoundError(f"no config.json in {source} (no such folder, .gguf file or "
                                f"shipped name): --model takes {causal_choices()}"
                                f"{hub_hint(path)}")  # "gpt2": say there is no hub
    if path.is_dir() and not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {source}: --model takes "
                                f"{causal_choices()}")
    is_causal_model(str(source), command, encoders=False)  # refuses other model types
    return load_lm_with_tokenizer(source, device=device, dtype=dtype, quantize=quantize)


class _TextStream:
    """Print the prompt, then the text of the generated ids as it grows (whole characters
    only; the end-of-text token is not printed; text that may begin a ``stop`` string is held
    back, and the text ends before one). ``count`` is the number of tokens seen."""

    def __init__(self, tokenizer: object, prompt: str, eos: int | None, out: object,
                 stop: list[str] | None = None) -> None:
        self.tokenizer, self.prompt, self.eos, self.out = tokenizer, prompt, eos, out
        from handformer.models.generation import stop_position  # imports torch: here

        self.stop, self.stop_position = stop or [], stop_position
        self.stopped = False
        self.ids: list[int] = []
        self.count = 0
        self.printed = -1  # -1: the prompt is not printed yet

    def _write(self, text: str) -> None:
        if self.printed < 0:
            self.out.write(self.prompt)
            self.printed = 0
        if len(text) < self.printed:  # (held-back text is never printed twice)
            return
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)

    def __call__(self, token: object) -> None:
        self.count += 1
        if int(token[0]) == self.eos or self.stopped:
            return
        self.ids.append(int(token[0]))
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):  # else an incomplete UTF-8 sequence: wait
            end, self.stopped = self.stop_position(text, self.stop)
            self._write(text[:end])

    def finish(self) -> None:
        text = self.tokenizer.decode(self.ids) if self.ids else ""
        self._write(text[:self.stop_position(text, self.stop)[0]] if self.stopped else text)
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
    if check_steering_flags(args) and args.chat is not None:
        raise UsageError("--steer goes with --prompt, not --chat")
    dtype = apply_decoding_options(args)
    if args.chat is not None:
        return _chat_once(args, dtype)
    if args.system is not None:
        raise UsageError("--system goes with --chat (a system message for an instruct model)")
    device = resolve_device(args.device)
    model, tokenizer = load_model_and_tokenizer(args.model, dtype=dtype, quantize=args.quantize)
    model.to(device)
    ids = tokenizer.encode(args.prompt)
    if not ids:
        raise UsageError("the prompt is empty after tokenization; give some text")
    max_len = model.config.max_len
    n, cut = new_token_count(args.max_new_tokens, len(ids), max_len)
    do_sample = any(v is not None for v in (args.temperature, args.top_k, args.top_p))
    eos = tokenizer.eos_token_id
    stream = _TextStream(tokenizer, args.prompt, eos, sys.stdout, args.stop)
    with steering(args, model):  # --steer FEATURE:COEF (nothing without it)
        model.generate(
            torch.tensor([ids], device=device), max_new_tokens=n, do_sample=do_sample,
            temperature=1.0 if args.temperature is None else args.temperature, top_k=args.top_k,
            top_p=args.top_p, eos_token_id=eos,
            generator=torch.Generator(device=device).manual_seed(args.seed),
            use_cache=not args.no_cache, streamer=stream,
            repetition_penalty=args.repetition_penalty or 1.0, stop=args.stop,
            tokenizer=tokenizer if args.stop else None,
        )
    stream.finish()
    if cut and n == 0:
        note(f"the prompt ({len(ids)} tokens) fills the model's context of {max_len} tokens; "
             "nothing was generated")
    elif cut and stream.count == n and not stream.stopped:  # not stopped by an end token
        note(f"stopped at the model's context limit: {len(ids)} prompt + {n} new = {max_len} "
             f"tokens (without --max-new-tokens, generate makes up to {DEFAULT_NEW_TOKENS} "
             "tokens, as many as fit)")
    return 0


def _chat_once(args: argparse.Namespace, dtype: object) -> int:
    """``generate --chat TEXT``: one turn of :class:`~handformer.chat.session.ChatSession`."""
    from handformer.commands.chat import open_session

    if args.no_cache:
        raise UsageError("--no-cache goes with --prompt, not --chat")
    session = open_session(args, CHAT_NEW_TOKENS if args.max_new_tokens is None
                           else args.max_new_tokens, dtype=dtype)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        session.send(args.chat, on_text=write)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    write("\n")
    return 0
