#!/usr/bin/env bash
# Create/refresh .venv, lint, then run the whole test suite (slow tests included). Extra args go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
echo "[test] ruff check"
ruff check .
echo "[test] pytest"
python -m pytest "$@"
