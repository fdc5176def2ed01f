#!/usr/bin/env bash
# CI step: compile and link tdx's CUDA part (csrc/cuda: the NCCL engine and the .cu kernels) against the CUDA build
# of torch, on a machine without a GPU, so that a CUDA build break fails CI.
#   - skips (exit 0, with a message) only when nvcc is absent;
#   - creates or reuses a virtual environment (TDX_CUDA_VENV, default /tmp/tdx-venv-cuda) with the
#     pinned requirements-cuda.txt (torch==2.14.1, the CUDA build), separate from the CPU torch;
#   - builds a copy of the working tree with TDX_CUDA=1 (a missing CUDA requirement is an error),
#     imports the module (torch's CUDA build imports without a GPU) and runs CPU tests against it.
set -euo pipefail
cd "$(dirname "$0")/../.."
START=$(date +%s)
if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "check_cuda_build: SKIPPED: nvcc not found, so the CUDA part cannot be compiled on this machine"
  exit 0
fi
command -v nvcc >/dev/null 2>&1 || export PATH=/usr/local/cuda/bin:$PATH
echo "check_cuda_build: $(nvcc --version | tail -1)"

VENV=${TDX_CUDA_VENV:-/tmp/tdx-venv-cuda}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q -r requirements-cuda.txt
echo "check_cuda_build: venv ready after $(( $(date +%s) - START )) s ($("$VENV/bin/python" -c 'import torch; print(torch.__version__)'))"

SRC=$(mktemp -d /tmp/tdx-cuda-build.XXXXXX)
trap 'rm -rf "$SRC"' EXIT
tar --exclude=./build --exclude=./.git --exclude='*.so' --exclude=__pycache__ -cf - . | tar -xf - -C "$SRC"
cd "$SRC"
export PYTHONPATH="$SRC"  # this copy, also for the ranks that torchrun starts (nothing is pip-installed here)
TDX_CUDA=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} "$VENV/bin/python" setup.py -q build_ext --inplace
echo "check_cuda_build: built after $(( $(date +%s) - START )) s"
"$VENV/bin/python" - <<'PY'
import torch
import torchdist_ext
from torchdist_ext import kernels

assert kernels.built_with_cuda(), "the CUDA build did not include the CUDA part"
print(f"check_cuda_build: imported {torchdist_ext.__file__} (torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, GPU available: {torch.cuda.is_available()})")
PY
# CPU tests against the CUDA build (the GPU tests skip themselves without a GPU).
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_cuda_path.py tests/test_backend.py tests/gpu
echo "check_cuda_build: OK in $(( $(date +%s) - START )) s"
