"""The ``handformer`` command line: one sub-command per module in ``handformer.commands``.

Every sub-command exits 0 on success and 2 with a one-line ``handformer CMD: error: ...``
message on bad input (never a traceback).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Sub-command modules; each defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and
# ``run(args) -> int``.
COMMANDS = [
    "handformer.commands.demo",
    "handformer.commands.train",
    "handformer.commands.embed",
    "handformer.commands.viz",
    "handformer.commands.generate",
    "handformer.commands.heads",
]


class UsageError(Exception):
    """Bad input from the command line: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line and exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="handformer", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in COMMANDS:
        module = importlib.import_module(name)
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``handformer`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (UsageError, ValueError, TypeError, OSError) as exc:
        message = " ".join(str(exc).split())  # one line
        sys.stderr.write(f"handformer {args.command}: error: {message}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write(f"handformer {args.command}: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
