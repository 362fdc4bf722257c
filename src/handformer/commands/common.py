"""What every sub-command shares: the usage error, one-line notes, the ``--device`` option.

* :class:`UsageError` -- bad input from the command line; ``handformer.cli.main`` prints it as
  one line (``handformer CMD: error: ...``) and exits 2.
* :func:`note` -- a one-line ``note: ...`` on stderr, for things the user should know that
  are not errors (text cut to the model's limit, generation stopped at the context). Notes go
  to stderr so that what a command prints on stdout (JSON, generated text) stays clean.
* :func:`add_device_argument` and :func:`resolve_device` -- the ``--device auto|cpu|cuda``
  option (``cuda:N`` picks a GPU), one resolution for every command that runs a model.
* :func:`add_decoding_options` and :func:`apply_decoding_options` -- ``--dtype``,
  ``--threads``, ``--stop``, ``--repetition-penalty``, shared by ``generate`` and ``chat``.
* :func:`flag_error`, :func:`check_attention_flags`, :func:`check_sampling_flags` -- the
  library's rules for attention kinds and sampling options (the same the server applies),
  with their errors in the command line's words (``--window-size``, not ``window_size``).
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported lazily: `handformer --help` stays fast
    import torch

from handformer.checks import OptionError

__all__ = ["UsageError", "note", "add_device_argument", "resolve_device", "DEVICE_HELP",
           "causal_choices", "model_choices", "is_causal_model", "flag_error",
           "check_attention_flags", "check_sampling_flags", "add_decoding_options",
           "apply_decoding_options"]

DEVICE_HELP = ("where the model runs: auto (CUDA if available, else CPU), cpu, cuda or cuda:N "
               "(default auto)")


class UsageError(ValueError):
    """Bad input from the command line: printed as one line, exit code 2."""


def note(message: str) -> None:
    """Print ``note: MESSAGE`` as one line on stderr (whitespace runs collapsed)."""
    sys.stderr.write("note: " + " ".join(str(message).split()) + "\n")
    sys.stderr.flush()


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--device`` (default ``auto``); pass ``args.device`` to :func:`resolve_device`."""
    parser.add_argument("--device", default="auto", metavar="DEVICE", help=DEVICE_HELP)


def resolve_device(name: str) -> torch.device:
    """The ``torch.device`` for a ``--device`` value.

    Args:
        name: ``"auto"`` (the first CUDA GPU if there is one, else the CPU), ``"cpu"``,
            ``"cuda"`` or ``"cuda:N"``.

    Returns:
        The device.

    Raises:
        UsageError: for another name, or CUDA asked for where there is none (the message
            says whether torch was built without CUDA or no GPU is visible), or a GPU index
            beyond the GPUs present.
    """
    import torch

    text = str(name).strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if text == "cpu":
        return torch.device("cpu")
    m = re.fullmatch(r"cuda(?::(\d+))?", text)
    if m is None:
        raise UsageError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if not torch.cuda.is_available():
        why = (f"this PyTorch build ({torch.__version__}) has no CUDA support"
               if torch.version.cuda is None else
               "no CUDA GPU is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)")
        raise UsageError(f"--device {name}: {why}; use --device cpu (or auto, which falls "
                         "back to the CPU)")
    index = int(m.group(1)) if m.group(1) is not None else 0
    count = torch.cuda.device_count()
    if index >= count:
        raise UsageError(f"--device {name}: there {'is' if count == 1 else 'are'} only "
                         f"{count} CUDA device{'s' * (count != 1)} (cuda:0..cuda:{count - 1})")
    return torch.device("cuda", index)


def causal_choices() -> str:
    """What ``--model`` takes for a causal language model, in words (with every supported
    ``model_type`` and the shipped names)."""
    from handformer.pretrained.families import supported_model_types
    from handformer.pretrained.lm import shipped_names

    shipped = ", ".join(shipped_names()) or "none installed"
    return (f"a causal LM folder (config.json model_type {', '.join(supported_model_types())}"
            f"), a .gguf file, or a shipped model name ({shipped})")


def model_choices(*, encoders: bool = True) -> str:
    """Everything a command's ``--model`` takes, in words."""
    if not encoders:
        return causal_choices()
    return ("a BERT-family encoder folder (model_type 'bert'; default: the bundled "
            "all-MiniLM-L6-v2), or " + causal_choices())


def is_causal_model(source: str | None, command: str, *, encoders: bool = True) -> bool:
    """Whether ``--model`` names a causal LM (True) or an encoder (False).

    A folder whose ``config.json`` has a ``model_type`` neither kind reads is refused here,
    naming everything ``command`` accepts.

    Raises:
        UsageError: for such a folder (or, without ``encoders``, for an encoder folder).
    """
    import json
    from pathlib import Path

    from handformer.pretrained.lm import is_causal_source

    if source is None:
        return False
    if is_causal_source(source):
        return True
    path = Path(source)
    folder = path.parent if path.is_file() else path
    try:
        model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get(
            "model_type", "bert")
    except (OSError, ValueError, AttributeError):
        return False  # no folder or no config: the loader says what is missing
    from handformer.pretrained.bert import BERT_FAMILY

    if encoders and model_type in BERT_FAMILY:
        return False
    extra = ("" if encoders else "; BERT-family encoders go to embed, viz, heads and serve")
    raise UsageError(f"--model {source}: model_type {model_type!r} is not a model {command} "
                     f"reads; it takes {model_choices(encoders=encoders)}{extra}")


def flag_error(exc: OptionError) -> UsageError:
    """An :class:`~handformer.checks.OptionError` in the command line's words."""
    from handformer.attention.registry import MisplacedOption

    flag = "--" + exc.name.replace("_", "-")
    if isinstance(exc, MisplacedOption):
        return UsageError(f"{flag} {exc.value} applies to --attention {exc.needs}, not "
                          f"--attention {exc.kind}; add --attention {exc.needs} or leave "
                          f"{flag} out")
    return UsageError(f"{flag} {exc.problem}")


def check_attention_flags(attention: str, **options: object) -> None:
    """Refuse an option of one attention kind given with another (``--window-size`` without
    ``--attention local``): the rule of
    :func:`~handformer.attention.registry.check_kind_options`, which the server applies too.

    Raises:
        UsageError: naming the flag.
    """
    from handformer.attention.registry import check_kind_options

    try:
        check_kind_options(attention, **options)
    except OptionError as exc:
        raise flag_error(exc) from None


def check_sampling_flags(**options: object) -> None:
    """``--temperature``, ``--top-k``, ``--top-p``, ``--seed`` by the library's rule
    (:func:`~handformer.models.generation.check_sampling`, which the server applies too).

    Raises:
        UsageError: naming the flag.
    """
    from handformer.models.generation import check_sampling

    try:
        check_sampling(**options)
    except OptionError as exc:
        if exc.name == "temperature" and "when sampling" in exc.problem:
            raise UsageError(f"--temperature must be > 0 when sampling, got "
                             f"{options['temperature']}; for greedy (deterministic) output "
                             "leave out --temperature, --top-k and --top-p: greedy decoding "
                             "is the default") from None
        raise flag_error(exc) from None


DTYPES = ("float32", "bfloat16")


def add_decoding_options(parser: argparse.ArgumentParser) -> None:
    """``--dtype``, ``--threads``, ``--stop`` (repeatable), ``--repetition-penalty``: what
    ``generate`` and ``chat`` share (checked by :func:`apply_decoding_options`)."""
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="the weights' dtype: float32 (default) or bfloat16 (half the "
                             "memory; slightly different numbers)")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="CPU threads for the model (default: PyTorch's choice, usually "
                             "the number of cores)")
    parser.add_argument("--stop", action="append", default=None, metavar="TEXT",
                        help="stop when the generated text contains TEXT (not printed); "
                             "repeat for several")
    parser.add_argument("--repetition-penalty", type=float, default=None, metavar="P",
                        help="lower the scores of tokens already in the text: a positive "
                             "score is divided by P, a negative one multiplied (as in "
                             "transformers; > 1 discourages repeats, e.g. 1.1; default off)")


def apply_decoding_options(args: argparse.Namespace) -> torch.dtype:
    """Check :func:`add_decoding_options`' flags (before the slow model load), set the
    thread count, and return the dtype.

    Raises:
        UsageError: naming the flag and the value.
    """
    import torch

    from handformer.checks import MAX_INT

    if args.threads is not None:
        if not 1 <= args.threads <= MAX_INT:
            raise UsageError(f"--threads must be an integer in [1, {MAX_INT}], got "
                             f"{args.threads}")
        torch.set_num_threads(args.threads)
    if args.stop is not None and not all(args.stop):
        raise UsageError("--stop must be non-empty text, got ''")
    check_sampling_flags(repetition_penalty=args.repetition_penalty)
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
