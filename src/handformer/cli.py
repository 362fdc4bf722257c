"""The ``handformer`` command line: one sub-command per module in ``handformer.commands``.

Exit status: 0 on success; 2 with a one-line ``handformer CMD: error: ...`` message on bad
input (never a traceback; an optional library that is not installed is bad input too: its
message names the pip line); 130 on Ctrl-C; 141 (128 + SIGPIPE, what the shell reports for a
Unix tool whose reader went away) when stdout is closed early, as in
``handformer viz TEXT | head -1``, silently. Warnings raised while a command runs are printed
as one-line ``note: ...`` lines on stderr, not as Python warnings with a source path.

Only the sub-command being run is imported (``handformer --help`` and ``--version`` import
no sub-command, hence neither torch): the top-level help lists each one with the summary in
:data:`COMMANDS`.

Adding a sub-command: write ``handformer/commands/NAME.py`` with ``NAME``, ``HELP``,
``add_arguments(parser)`` (its parser, and only its parser) and ``run(args) -> int``
(importing heavy libraries inside ``run``), and list it in :data:`COMMANDS`. Shared pieces
(``UsageError``, ``note``, ``--device``) are in :mod:`handformer.commands.common`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys
import warnings

from handformer.commands.common import UsageError, note

__all__ = ["COMMANDS", "UsageError", "build_parser", "main"]

# (name, module, summary in the top-level help). Each module defines ``NAME``, ``HELP`` (its
# own help's description), ``add_arguments(parser)`` and ``run(args) -> int``.
COMMANDS = [
    ("demo", "handformer.commands.demo",
     "Run a tiny random encoder on a sentence and print shapes and one head."),
    ("train", "handformer.commands.train",
     "Train a small decoder-only model (copy, reverse, sort, or a text file)."),
    ("embed", "handformer.commands.embed",
     "Embed sentences with a BERT-family model and print their similarities."),
    ("viz", "handformer.commands.viz",
     "Draw a model's attention on a text (head.png, model.png, index.html)."),
    ("generate", "handformer.commands.generate",
     "Continue a prompt with a language model (a folder, a .gguf file or a shipped LLM)."),
    ("chat", "handformer.commands.chat", "Chat with an instruct model in the terminal."),
    ("heads", "handformer.commands.heads",
     "Switch off each attention head in turn and show what it changes."),
    ("serve", "handformer.commands.serve",
     "Serve a web app: type text, see the attention, switch off heads, generate."),
    ("train-sae", "handformer.commands.train_sae",
     "Train sparse autoencoders or transcoders on a model's activations."),
]

DESCRIPTION = ("Look inside Transformers, run local language models and train small ones. "
               "Every model runs on this machine: nothing is downloaded.")
EPILOG = ("Run 'handformer COMMAND --help' for a command's options. Exit status: 0 on success, "
          "2 for bad input (a one-line error), 130 when interrupted.")

EXIT_USAGE, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 2, 130, 141


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line and exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(EXIT_USAGE)


class _Formatter(argparse.HelpFormatter):
    """argparse's formatter, counting a sub-command's indent when it lines up the summaries
    (argparse leaves it out, so a name of 9 letters, ``train-sae``, wrapped onto its own line)."""

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        names = [len(self._format_action_invocation(s)) for s in getattr(action, "_get_subactions",
                                                                         list)()]
        if action.help is not argparse.SUPPRESS and names:
            self._action_max_length = max(self._action_max_length,
                                          max(names) + self._current_indent + 2)


def version() -> str:
    """The installed package's version (the source tree's where it is not installed)."""
    try:
        return importlib.metadata.version("handformer")
    except importlib.metadata.PackageNotFoundError:
        import handformer

        return handformer.__version__


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``handformer`` parser, one sub-parser per entry of :data:`COMMANDS`.

    Args:
        command: fill in this sub-command's options only (importing its module and no other;
            a name that is no sub-command imports none); None: every sub-command's.

    Returns:
        The parser.
    """
    parser = _Parser(prog="handformer", description=DESCRIPTION, epilog=EPILOG,
                     formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"handformer {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, module_name, summary in COMMANDS:
        if command is not None and name != command:
            sub.add_parser(name, help=summary)  # listed; its options are not needed
            continue
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=summary, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def _command_of(argv: list[str]) -> str:
    """The sub-command named in ``argv`` ("" for none): its first word that is no option
    (the top-level options, --help and --version, take no value)."""
    return next((a for a in argv if not a.startswith("-")), "")


def _warning_as_note(message: Warning | str, category: type[Warning], filename: str,
                     lineno: int, file: object = None, line: str | None = None) -> None:
    """``warnings.showwarning`` for the CLI: the message only, as one ``note:`` line."""
    note(str(message))


def _run(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    parser = build_parser(_command_of(argv))
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings():  # restores the hook below when the command ends
            warnings.showwarning = _warning_as_note
            return int(args._run(args) or 0)
    except BrokenPipeError:
        raise  # handled by main(): not a usage error
    except (UsageError, ValueError, TypeError, OSError, ModuleNotFoundError) as exc:
        message = " ".join(str(exc).split())  # one line
        sys.stderr.write(f"handformer {args.command}: error: {message}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stderr.write(f"handformer {args.command}: interrupted\n")
        return EXIT_INTERRUPTED


def _discard_stdout() -> None:
    """Point stdout's file descriptor at /dev/null, so that the interpreter's final flush of
    what is still buffered does not fail a second time."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (tests, notebooks)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``handformer`` console script (``argv`` default: ``sys.argv``)."""
    try:
        try:
            return _run(argv)
        finally:
            sys.stdout.flush()  # inside the try: a reader gone away is handled below
    except BrokenPipeError:  # e.g. `handformer viz ... | head -1`: stop quietly
        _discard_stdout()
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
