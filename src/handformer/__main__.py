"""``python -m handformer`` (what ``torchrun -m handformer`` runs)."""

import sys

from handformer.cli import main

sys.exit(main())
