"""``python -m mixprec`` (also what ``torchrun -m mixprec`` runs)."""

import sys

from .cli import main

sys.exit(main())
