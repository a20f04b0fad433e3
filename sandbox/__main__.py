"""``python -m sandbox serve ...`` / ``python -m sandbox probe``: see ``sandbox.cli``."""

import sys

from .cli import main

sys.exit(main(sys.argv[1:]))
