"""Sub-commands of the ``handformer`` CLI (see :mod:`handformer.cli`)."""
