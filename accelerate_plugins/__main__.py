"""``python -m accelerate_plugins launch ...``: `accelerate launch` with a PaRO settings file (see `.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
