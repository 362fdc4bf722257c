"""Sub-commands of the ``handformer`` CLI (see :mod:`handformer.cli`, which imports them).

Shared pieces (``UsageError``, ``note``, ``--device``) live in
:mod:`handformer.commands.common`, below the CLI, so that sub-commands never import
:mod:`handformer.cli` (imports go one way: cli -> commands).
"""
