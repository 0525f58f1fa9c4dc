"""``python -m minirt.hitcheck``: see ``minirt.hitcheck.cli``."""

import sys

from .cli import main

sys.exit(main())
