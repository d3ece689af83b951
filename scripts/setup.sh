#!/usr/bin/env bash
# Creates .venv (if missing) and installs hydraloop with its dev and vision extras into it. Idempotent.
#
# torch is installed first when missing, pinned, because a bare requirement would pull whatever build the index
# serves; set TORCH_SPEC to choose another (a single requirement, e.g. TORCH_SPEC="torch==2.6.0").
# torchvision (the `vision` extra) must be the release built for the installed torch, and every torchvision wheel
# pins its torch exactly: torch 2.N pairs with torchvision 0.(N+15), e.g. 2.6 <-> 0.21, 2.13 <-> 0.28,
# 2.14 <-> 0.29. A bare `torchvision` would pull the newest one, whose torch pin replaces the installed torch; so a
# constraint holds torch at its installed version and torchvision at the matching 0.(N+15).*.
# Both must also come from the same kind of build (CPU or CUDA): with a +cpu torch, install torchvision from the
# same index (PIP_INDEX_URL), or delete .venv to take the default pair, torch 2.14.1 with torchvision 0.29.1.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install --quiet "${TORCH_SPEC:-torch==2.14.1}"
fi
# The version pip records (torch.__version__ may add a local label, such as +cu130, that pip's metadata lacks).
torch_version=$(.venv/bin/python -c "from importlib.metadata import version; print(version('torch'))")
IFS=. read -r major minor _ <<<"$torch_version"
if [ "$major" != 2 ]; then
  echo "setup: torch $torch_version: no known torchvision release for it (torch 2.N pairs with 0.(N+15))" >&2
  exit 1
fi
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
printf 'torch==%s\ntorchvision==0.%d.*\n' "$torch_version" "$((minor + 15))" >"$constraints"
.venv/bin/python -m pip install --quiet --constraint "$constraints" -e ".[dev,vision]"
if ! .venv/bin/python -c "import torchvision" 2>/dev/null; then
  vision_version=$(.venv/bin/python -m pip show torchvision 2>/dev/null | sed -n 's/^Version: //p')
  # Uninstalled again, so that a rerun from another index does not find it already there.
  .venv/bin/python -m pip uninstall --quiet --yes torchvision
  echo "setup: torchvision $vision_version does not load beside torch $torch_version (a CUDA torchvision needs a" \
    "CUDA torch; removed it again): delete .venv and rerun to take torch 2.14.1 with torchvision 0.29.1, or rerun" \
    "with both from one index, e.g. PIP_INDEX_URL=https://download.pytorch.org/whl/cpu" >&2
  exit 1
fi
