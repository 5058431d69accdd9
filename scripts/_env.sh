# Shared by scripts/test.sh and scripts/demo.sh: create or refresh .venv, then stay quiet on later runs.
# The install is redone only when pyproject.toml changes (a stamp holds its hash), so a second run starts at once.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV="$ROOT/.venv"
STAMP="$VENV/.hf-scale-plugins.stamp"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)-torch2.13.0"
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[env] creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$want" ]]; then
  echo "[env] installing torch==2.13.0 (CPU) and hf-scale-plugins[test,deepspeed,plot] (editable)"
  # torch first and pinned: on these machines 2.13.0 is a CPU wheel on disk; an unpinned request pulls CUDA builds.
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "torch==2.13.0" -e ".[test,deepspeed,plot]" \
    2>&1 | grep -v "is ignored" || true
  "$VENV/bin/python" -c "import torch, hf_placement; assert torch.__version__.startswith('2.13.0'), torch.__version__"
  echo "$want" > "$STAMP"
else
  echo "[env] $VENV is up to date"
fi
export PATH="$VENV/bin:$PATH"
export TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1
export HF_DATASETS_OFFLINE=1
export TRANSFORMERS_NO_ADVISORY_WARNINGS=1
