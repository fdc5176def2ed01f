#!/usr/bin/env bash
# One command on a GPU machine: builds tdx with its CUDA part against the installed torch (no
# downloads; torch's CUDA build and its nvidia-nccl package must already be installed), then runs
# the GPU tests (tests/gpu) and the GPU benchmarks, writing everything to one folder.
#   tests/gpu/run.sh [results folder, default $OUT or ./gpu-results]
# The compiler is torch's choice ($CXX, else c++). Build with the compiler torch was built with (or
# the same version of the system's): on the GPU image this project was lent, CXX pointed at a
# wrapper (/opt/gcc/bin/g++) whose extension crashed (SIGSEGV) on the first C++ exception, and
# CXX=/usr/bin/g++ CC=/usr/bin/gcc tests/gpu/run.sh built one that passes.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the in-place build, for bench_gpu.py too
PY=${PYTHON:-python3}
RESULTS=${1:-${OUT:-gpu-results}}
mkdir -p "$RESULTS"
{
  echo "host: $(uname -n), $(nproc) cores"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: none"
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
  echo "compiler: ${CXX:-c++} ($("${CXX:-c++}" --version 2>/dev/null | head -1))"
} 2>&1 | tee "$RESULTS/env.txt"
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "tests/gpu/run.sh: no CUDA GPU visible to torch; nothing to run" | tee -a "$RESULTS/env.txt"
  exit 1
fi
set -e
if ! TDX_CUDA=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" setup.py -q build_ext --inplace >"$RESULTS/build.txt" 2>&1; then
  grep -E -A6 "error|Error" "$RESULTS/build.txt" | head -80
  echo "tests/gpu/run.sh: the build failed; the whole log is $RESULTS/build.txt" | tee "$RESULTS/summary.txt"
  exit 1
fi
"$PY" -c 'import torchdist_ext.kernels as k; assert k.built_with_cuda(), "built without the CUDA part"'
# a hung test fails alone (pytest-timeout, when installed) instead of eating the whole run
TO=$("$PY" -c 'import pytest_timeout' 2>/dev/null && echo "--timeout=${TDX_TEST_TIMEOUT:-300}")
set +e
# one pytest per file, so that a crash in one file still leaves the others' summaries
TESTS=0
for f in tests/gpu/test_*.py; do
  "$PY" -m pytest -v -rfE --tb=short -p no:cacheprovider $TO "$f" 2>&1 | tee -a "$RESULTS/gpu-tests.txt"
  rc=${PIPESTATUS[0]}; [ "$rc" -ne 0 ] && TESTS=$rc
done
"$PY" -m pytest -q -p no:cacheprovider $TO -x tests/test_kernels.py tests/test_cuda_path.py tests/test_collectives.py \
  2>&1 | tee "$RESULTS/cpu-tests-on-cuda-build.txt"
CPU=${PIPESTATUS[0]}
"$PY" tests/gpu/bench_gpu.py --out "$RESULTS/gpu-bench.json" 2>&1 | tee "$RESULTS/gpu-bench.txt"
BENCH=${PIPESTATUS[0]}
echo "tests/gpu/run.sh: gpu tests rc=$TESTS, cpu tests on the CUDA build rc=$CPU, benchmarks rc=$BENCH; results in $RESULTS" \
  | tee "$RESULTS/summary.txt"
[ "$TESTS" -eq 0 ] && [ "$CPU" -eq 0 ] && [ "$BENCH" -eq 0 ]
