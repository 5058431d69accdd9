"""``python -m hf_placement.planner`` = ``python -m hf_placement`` (plan, calibrate)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
