"""The ``handformer`` command line: one sub-command per module in ``handformer.commands``.

Exit status: 0 on success; 2 with a one-line ``handformer CMD: error: ...`` message on bad
input (never a traceback); 130 on Ctrl-C; 141 (128 + SIGPIPE, what the shell reports for a
Unix tool whose reader went away) when stdout is closed early, as in
``handformer viz TEXT | head -1``, silently. Warnings raised while a command runs are printed
as one-line ``note: ...`` lines on stderr, not as Python warnings with a source path.

Adding a sub-command: write ``handformer/commands/NAME.py`` with ``NAME``, ``HELP``,
``add_arguments(parser)`` (its parser, and only its parser) and ``run(args) -> int``, and
list the module in :data:`COMMANDS`. Shared pieces (``UsageError``, ``note``, ``--device``)
are in :mod:`handformer.commands.common`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

from handformer.commands.common import UsageError, note

__all__ = ["COMMANDS", "UsageError", "build_parser", "main"]

# Sub-command modules; each defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and
# ``run(args) -> int``.
COMMANDS = [
    "handformer.commands.demo",
    "handformer.commands.train",
    "handformer.commands.embed",
    "handformer.commands.viz",
    "handformer.commands.generate",
    "handformer.commands.chat",
    "handformer.commands.heads",
    "handformer.commands.serve",
    "handformer.commands.train_sae",
]

EXIT_USAGE, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 2, 130, 141


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line and exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    """The ``handformer`` parser with one sub-parser per module of :data:`COMMANDS`."""
    parser = _Parser(prog="handformer", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in COMMANDS:
        module = importlib.import_module(name)
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def _warning_as_note(message: Warning | str, category: type[Warning], filename: str,
                     lineno: int, file: object = None, line: str | None = None) -> None:
    """``warnings.showwarning`` for the CLI: the message only, as one ``note:`` line."""
    note(str(message))


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings():  # restores the hook below when the command ends
            warnings.showwarning = _warning_as_note
            return int(args._run(args) or 0)
    except BrokenPipeError:
        raise  # handled by main(): not a usage error
    except (UsageError, ValueError, TypeError, OSError) as exc:
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
