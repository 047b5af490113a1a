"""``python -m m2r2`` runs the CLI."""

import sys

from m2r2.cli import main

sys.exit(main())
