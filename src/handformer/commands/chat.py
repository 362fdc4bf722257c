"""``handformer chat``: talk with an instruct model in the terminal.

Each line you type is a user message; the reply streams as it is generated and stops at the
model's end-of-turn token. The conversation is kept (the model sees the whole history through
its chat template) until ``/reset``; ``/exit`` or Ctrl+D leaves. A base model (no chat
template, e.g. ``gemma3-270m``) is refused in one line: use ``generate --prompt``.

``--model`` takes what ``load_lm`` reads: a shipped name (``smollm2-135m-instruct``), a
``.gguf`` file or a Hugging Face causal-LM folder. ``--stop``, ``--repetition-penalty``,
``--dtype`` and ``--threads`` work as in ``generate``.
"""

from __future__ import annotations

import argparse
import sys

from handformer.commands.common import (
    UsageError,
    add_decoding_options,
    add_device_argument,
    apply_decoding_options,
    resolve_device,
)

NAME = "chat"
HELP = "Chat with an instruct model (a shipped name, a .gguf file or a model folder)."

MODEL_HELP = ("a shipped model name (smollm2-135m-instruct, gemma3-270m), a .gguf file or a "
              "Hugging Face causal-LM folder")


def add_chat_options(parser: argparse.ArgumentParser) -> None:
    """``--system`` (shared with ``generate --chat``)."""
    parser.add_argument("--system", metavar="TEXT", default=None,
                        help="a system message at the top of the conversation")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="MODEL", required=True, help=MODEL_HELP)
    add_chat_options(parser)
    parser.add_argument("--max-new-tokens", type=int, default=256, metavar="N",
                        help="the most tokens per reply (default 256)")
    parser.add_argument("--temperature", type=float, default=None, metavar="T",
                        help="sample with this temperature (> 0); greedy by default")
    parser.add_argument("--top-k", type=int, default=None, metavar="K",
                        help="sample among the K most likely tokens")
    parser.add_argument("--top-p", type=float, default=None, metavar="P",
                        help="nucleus sampling threshold in (0, 1]")
    parser.add_argument("--seed", type=int, default=0, metavar="S",
                        help="random seed for sampling (default 0)")
    add_decoding_options(parser)
    add_device_argument(parser)
    parser.add_argument("--quantize", choices=["int8", "int4"], default=None,
                        help="int8 or 4-bit weights for the linear layers (CPU; see docs/llms.md)")


def open_session(args: argparse.Namespace, max_new_tokens: int, *, dtype: object = None
                 ) -> object:
    """Load ``args.model`` and start a :class:`~handformer.chat.session.ChatSession`.

    Raises:
        UsageError: for a model without a chat template or bad settings.
    """
    from handformer.chat.session import ChatSession, check_chat_model
    from handformer.pretrained import load_lm

    device = resolve_device(args.device)
    model, tokenizer = load_lm(args.model, device=device, dtype=dtype, quantize=args.quantize)
    try:
        check_chat_model(tokenizer, str(args.model))
        return ChatSession(model, tokenizer, system=args.system, max_new_tokens=max_new_tokens,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                           seed=args.seed, source=str(args.model), stop=args.stop,
                           repetition_penalty=args.repetition_penalty)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    from handformer.chat.template import ChatTemplateError
    from handformer.checks import MAX_INT
    from handformer.commands.common import check_sampling_flags

    check_sampling_flags(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                         seed=args.seed)  # before the (slow) model load
    if not 1 <= args.max_new_tokens <= MAX_INT:
        raise UsageError(f"--max-new-tokens must be an integer in [1, {MAX_INT}], got "
                         f"{args.max_new_tokens}")
    dtype = apply_decoding_options(args)
    session = open_session(args, args.max_new_tokens, dtype=dtype)
    interactive = sys.stdin.isatty()
    if interactive:
        sys.stderr.write("Type a message; /reset forgets the conversation, /exit or Ctrl+D "
                         "leaves.\n")
    while True:
        if interactive:
            sys.stderr.write("> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:  # Ctrl+D / end of input
            break
        text = line.strip()
        if not text:
            continue
        if text == "/exit":
            break
        if text == "/reset":
            session.reset()
            sys.stderr.write("(conversation reset)\n")
            continue
        try:
            session.send(text, on_text=_write)
        except ChatTemplateError as exc:  # no turn can be rendered: stop, exit 2
            raise UsageError(str(exc)) from None
        except ValueError as exc:  # e.g. the history outgrew the context
            sys.stderr.write(f"handformer chat: {' '.join(str(exc).split())}\n")
            continue
        _write("\n")
    return 0
