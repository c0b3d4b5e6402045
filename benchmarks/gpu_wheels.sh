#!/usr/bin/env bash
# The wheels the GPU check brings to a bare GPU machine (docs/benchmarks.md, "The GPU check"): the packages
# the checked code imports that the GPU image (Python 3.12, torch, transformers, peft, safetensors, numpy,
# tokenizers) lacks, pinned to the versions .venv runs, for CPython 3.12 on x86-64 Linux:
#   llguidance  the engine imports it (grammar masks; compiled, abi3, glibc >= 2.31)
#   simpleeval  the graders import it (the co-serving benchmark imports the graders; pure Python)
# Usage: bash benchmarks/gpu_wheels.sh [DEST]   (default benchmarks/gpu_wheels/, git-ignored; `make gpu-wheels`)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
PY=${PY:-$ROOT/.venv/bin/python}
DEST=${1:-$HERE/gpu_wheels}
LIMIT_MIB=16  # the machine takes 64 MiB in all, the working tree included (about 4 MiB)

specs=()
for package in llguidance simpleeval; do
  version=$("$PY" -c "import importlib.metadata as m; print(m.version('$package'))")
  specs+=("$package==$version")
done
rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux2014_x86_64 -d "$DEST" "${specs[@]}"
ls -l "$DEST"
total=$(du -sk "$DEST" | cut -f1)
echo "gpu_wheels: ${specs[*]} -> $DEST ($((total / 1024)) MiB, $total KiB)"
if ((total > LIMIT_MIB * 1024)); then
  echo "gpu_wheels: more than $LIMIT_MIB MiB: too much to bring" >&2
  exit 1
fi
