#!/usr/bin/env bash
# The GPU check on a bare GPU machine (docs/benchmarks.md, "The GPU check"): installs the brought wheels
# (benchmarks/gpu_wheels/, from `make gpu-wheels`) into a temporary folder put on PYTHONPATH, then runs
# benchmarks/gpu_check.py with the given flags; its report goes to $OUT (or --out).
# Usage: bash benchmarks/gpu_check.sh [--parts a,b] [--budget-s S] [--device cpu --quick] ...
#   PYTHON=...      the interpreter (default: python3)
#   GPU_WHEELS=...  the wheels' folder (default: benchmarks/gpu_wheels)
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
PY=${PYTHON:-$(command -v python3 || command -v python)}
WHEELS=${GPU_WHEELS:-$HERE/gpu_wheels}
TARGET=$(mktemp -d "${TMPDIR:-/tmp}/coserve-gpu-check.XXXXXX")
trap 'rm -rf "$TARGET"' EXIT

shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if ((${#wheels[@]})); then
  if ! "$PY" -m pip install --quiet --no-deps --no-index --disable-pip-version-check --target "$TARGET/site" \
      "${wheels[@]}"; then
    echo "gpu_check.sh: pip could not install the wheels; unpacking them instead" >&2
    for wheel in "${wheels[@]}"; do "$PY" -m zipfile -e "$wheel" "$TARGET/site"; done
  fi
  echo "gpu_check.sh: brought $(cd "$WHEELS" && echo *.whl)" >&2
else
  echo "gpu_check.sh: no wheels in $WHEELS (make gpu-wheels); llguidance and simpleeval must be there already" >&2
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader >&2 || true
fi
export PYTHONPATH="$ROOT:$TARGET/site${PYTHONPATH:+:$PYTHONPATH}"
export COSERVE_CACHE_DIR="${COSERVE_CACHE_DIR:-$TARGET/cache}"  # the C kernel's build (CPU runs only)
"$PY" "$HERE/gpu_check.py" "$@"
