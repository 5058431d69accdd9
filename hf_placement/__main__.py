"""``python -m hf_placement plan|calibrate``: the planner's CLI (`hf_placement.planner.cli`)."""

import sys

from .planner.cli import main

if __name__ == "__main__":
    sys.exit(main())
