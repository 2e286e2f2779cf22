"""``python -m elsi``."""

import sys

from elsi.cli import main

sys.exit(main())
