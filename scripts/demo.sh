#!/usr/bin/env bash
# Create/refresh .venv, then tour every component on embedded defaults (tiny models, generated data).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
python examples/tour.py "$@"
