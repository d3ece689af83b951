#!/usr/bin/env bash
# The GPU check: one command for a GPU machine lent for a few minutes, which may be offline and come with a CUDA
# PyTorch already installed. About 6 minutes on one modern GPU (scripts/gpu_check.py lists the steps).
#
#   bash scripts/gpu_check.sh [OUT_DIR] [--device cuda|cpu] [--budget-s 340]   # OUT_DIR: outputs/gpu_check
#   bash scripts/gpu_check.sh outputs/gpu_dry_run --device cpu                 # a dry run of every step, on the CPU
#
# It uses the PyTorch it finds and never installs or replaces one: $PYTHON if set, else .venv/bin/python when the
# project's venv exists, else python3 (a GPU image's own). hydraloop itself runs from src/ (no install). What else it
# needs and the machine lacks, it installs, without dependencies, into OUT_DIR/site from a folder of wheels, $WHEELS
# (default wheels/). Fill that folder on a machine with network, for the GPU machine's Python version:
#
#   python3 -m pip wheel --no-deps -w wheels hydra-core==1.3.2 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 \
#       mnist1d==0.0.2.post1 tqdm pytest pluggy iniconfig pygments
#
# (all pure Python, so any Python 3 builds them; antlr4-python3-runtime comes only as source, which `pip wheel` builds).
# numpy, scipy, scikit-learn, matplotlib, requests, PyYAML and packaging are expected on the machine, as they are on
# CUDA PyTorch images. Exits non-zero only when a step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=outputs/gpu_check
[ $# -gt 0 ] && [ "${1#-}" = "$1" ] && { out=$1; shift; }
mkdir -p "$out"

if [ -n "${PYTHON:-}" ]; then python=$PYTHON
elif [ -x .venv/bin/python ]; then python=.venv/bin/python
else python=python3
fi
"$python" -c "import torch" 2>/dev/null || { echo "gpu_check: $python has no torch: set PYTHON to one that has" >&2; exit 1; }

# Import name and distribution of each package the steps need beyond torch and what GPU images carry.
needed="hydra:hydra-core omegaconf:omegaconf antlr4:antlr4-python3-runtime mnist1d:mnist1d tqdm:tqdm pytest:pytest"
missing=$("$python" - $needed <<'EOF'
import importlib.util, sys
print(" ".join(dist for module, dist in (arg.split(":") for arg in sys.argv[1:]) if not importlib.util.find_spec(module)))
EOF
)
site=$(cd "$out" && pwd)/site
if [ -n "$missing" ]; then
    wheels=${WHEELS:-wheels}
    echo "gpu_check: installing $missing from $wheels into $site (no dependencies, no network)"
    [ "$missing" != "${missing/pytest/}" ] && missing="$missing pluggy iniconfig pygments"
    "$python" -m pip install --quiet --no-index --no-deps --find-links "$wheels" --target "$site" $missing || {
        echo "gpu_check: could not install $missing from $wheels: fill it with the pip wheel command at the top of $0" >&2
        exit 1
    }
fi
export PYTHONPATH="$PWD/src:$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" scripts/gpu_check.py "$out" "$@"
