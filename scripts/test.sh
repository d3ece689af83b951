#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite on two pytest-xdist workers: one process leaves a core idle
# while a test waits on the processes it starts (two workers: 27 min on 2 cores, 2026-12-07). Extra
# arguments go to pytest (`-n 0`: one process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
set +e
.venv/bin/python -m pytest -n 2 --dist worksteal --durations=40 "$@"  # the slowest, to keep the suite in its budget
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: failing, since a green run must have tested something" >&2
  exit 1
fi
exit "$status"
