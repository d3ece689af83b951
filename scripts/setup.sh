#!/usr/bin/env bash
# Creates .venv (if missing) and installs hydraloop with its dev extra into it. Idempotent.
# Torch is installed first when missing, pinned, because a bare requirement would pull whatever build the index
# serves; set TORCH_SPEC to choose another (e.g. TORCH_SPEC="torch==2.6.0").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
fi
.venv/bin/python -m pip install --quiet -e ".[dev]"
