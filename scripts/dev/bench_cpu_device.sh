#!/usr/bin/env bash
# #20's check on a 16-core machine without a package registry (the device tool's), in one call that
# fits its 10-minute limit: builds the CPU part, runs the anchors (scripts/dev/bench_cpu_anchors.sh)
# at 4, 8 and 2 ranks without gloo, then alternating A/B runs of the one-shot limit at 4 and 8 ranks
# (TDX_ONESHOT_BYTES: the default against the limit before it).
#
#   OUTDIR=DIR WHEELS=.whl bash scripts/dev/bench_cpu_device.sh
#   RANKS="8 4 2" AB=0 ANCHORS_S="220 160 100" ... # other rank counts, no A/B, a limit for each
#   ANCHORS=0 ...                                   # the A/B alone
#
# WHEELS holds the cp312 wheels that docs/performance.md "4 and 8 ranks" lists. Every part runs under
# a timeout, so a slow machine still returns what finished. Output: DIR/cpu-<n>rank-<cores>core-anchors.txt,
# DIR/ab.txt, DIR/machine.txt, DIR/build.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUTDIR=${OUTDIR:-${OUT:-bench-out}}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUTDIR"
{ date -u; uptime; lscpu; lscpu -e; } > "$OUTDIR/machine.txt" 2>&1
t0=$(date +%s)
# /usr/bin/g++ whatever CXX says: the device image sets CXX=/opt/gcc/bin/g++, whose build of tdx
# crashes (SIGSEGV) on its first C++ exception (tests/gpu/run.sh)
rm -rf build
CXX=/usr/bin/g++ CC=/usr/bin/gcc TDX_CUDA=0 MAX_JOBS=$(nproc) \
  python3 setup.py -q build_ext --inplace > "$OUTDIR/build.txt" 2>&1 || { tail -40 "$OUTDIR/build.txt"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
# ANCHORS_S bounds each rank count's run (one value for all, or one per entry of RANKS), so a slow
# one does not take the next one's time.
limits=(${ANCHORS_S:-420}); i=0
[ "${ANCHORS:-1}" = 1 ] || RANKS=none
for n in ${RANKS:-4 8 2}; do
  [ "$n" = none ] && break
  limit=${limits[$i]:-${limits[-1]}}; i=$((i + 1))
  RANKS=$n BACKENDS=${BACKENDS:-tdx,tdx-direct,mpi,deepspeed,noop} WHEELS=$WHEELS OUTDIR=$OUTDIR \
    BENCH_ARGS=${BENCH_ARGS:-"--iters 200 --rounds 3 --iter-bytes 1G"} \
    timeout "$limit" bash scripts/dev/bench_cpu_anchors.sh > /dev/null
  echo "anchors, $n ranks (rc $?): $(( $(date +%s) - t0 )) s"
done
[ "${AB:-1}" = 1 ] || exit 0  # AB=0: the anchors only
# The A/B: the default against one other value, alternating, twice each.
export PYTHONPATH=$PWD
ab() {  # ranks collective knob value min-bytes max-bytes
  for rep in 1 2; do
    for env in "" "--env $3=$4"; do
      echo "## ${env:-default}" >> "$OUTDIR/ab.txt"
      timeout 60 python3 -u -m torchdist_ext.bench collectives -c "$2" -n "$1" --backends tdx-direct \
        --min-bytes "$5" --max-bytes "$6" --step-factor 2 --iters 400 --rounds 3 --iter-bytes 512M \
        --mem-bytes 0 $env 2>&1 | grep -E "^ +[0-9]" >> "$OUTDIR/ab.txt"
    done
  done
}
# The one-shot limit (256 KiB / ranks^2) against the one before it (128 KiB / ranks).
echo "# all_reduce, 8 ranks: default TDX_ONESHOT_BYTES (4K) vs 16K" >> "$OUTDIR/ab.txt"
ab 8 all_reduce TDX_ONESHOT_BYTES 16K 4K 64K
echo "# all_reduce, 4 ranks: default TDX_ONESHOT_BYTES (16K) vs 32K" >> "$OUTDIR/ab.txt"
ab 4 all_reduce TDX_ONESHOT_BYTES 32K 4K 64K
echo "all: $(( $(date +%s) - t0 )) s"
