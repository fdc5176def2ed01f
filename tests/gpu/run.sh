#!/usr/bin/env bash
# One command on a GPU machine: builds tdx with its CUDA part against the installed torch (no
# downloads; torch's CUDA build and its nvidia-nccl package must already be installed), then runs
# the GPU tests (tests/gpu) and the GPU benchmarks, writing everything to one folder.
#   tests/gpu/run.sh [results folder, default $OUT or ./gpu-results]
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
RESULTS=${1:-${OUT:-gpu-results}}
mkdir -p "$RESULTS"
{
  echo "host: $(uname -n), $(nproc) cores"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: none"
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
} 2>&1 | tee "$RESULTS/env.txt"
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "tests/gpu/run.sh: no CUDA GPU visible to torch; nothing to run" | tee -a "$RESULTS/env.txt"
  exit 1
fi
set -e
TDX_CUDA=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" setup.py -q build_ext --inplace 2>&1 | tail -20 | tee "$RESULTS/build.txt"
"$PY" -c 'import torchdist_ext.kernels as k; assert k.built_with_cuda(), "built without the CUDA part"'
set +e
"$PY" -m pytest -v -p no:cacheprovider tests/gpu 2>&1 | tee "$RESULTS/gpu-tests.txt"
TESTS=${PIPESTATUS[0]}
"$PY" -m pytest -q -p no:cacheprovider -x tests/test_kernels.py tests/test_cuda_path.py tests/test_collectives.py \
  2>&1 | tee "$RESULTS/cpu-tests-on-cuda-build.txt"
CPU=${PIPESTATUS[0]}
"$PY" tests/gpu/bench_gpu.py --out "$RESULTS/gpu-bench.json" 2>&1 | tee "$RESULTS/gpu-bench.txt"
BENCH=${PIPESTATUS[0]}
echo "tests/gpu/run.sh: gpu tests rc=$TESTS, cpu tests on the CUDA build rc=$CPU, benchmarks rc=$BENCH; results in $RESULTS" \
  | tee "$RESULTS/summary.txt"
[ "$TESTS" -eq 0 ] && [ "$CPU" -eq 0 ] && [ "$BENCH" -eq 0 ]
