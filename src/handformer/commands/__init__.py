"""Sub-commands of the ``handformer`` CLI (see :mod:`handformer.cli`, which imports them).

:class:`UsageError` lives here, below the CLI, so that sub-commands can raise it without
importing :mod:`handformer.cli` (imports go one way: cli -> commands).
"""

__all__ = ["UsageError"]


class UsageError(Exception):
    """Bad input from the command line: printed as one line, exit code 2."""
