#!/usr/bin/env bash
# A/B of two checkouts of torchdist_ext (each with its extension built in place) on one machine:
# the same benchmark, run from each checkout in turn, ROUNDS times, every run with gloo as its
# anchor, so the two builds' tdx/gloo ratios are measured beside each other on the same machine
# state. Run it on a quiet machine (`uptime` first).
#
#   scripts/dev/ab_builds.sh BEFORE_DIR AFTER_DIR BENCH_ARGS...
#   # one host, 2 ranks, every collective:
#   scripts/dev/ab_builds.sh ../main . collectives --collective all_reduce --world-size 2 --backends tdx,gloo
#   # 2 test hosts x 2 ranks (root), unshaped and at 10 Gbit/s:
#   scripts/dev/ab_builds.sh ../main . hosts --hosts 2 --nproc-per-node 2 --link none -c all \
#       --sizes 4K,64K,256K,1M,4M,16M --repeats 5
#   scripts/dev/ab_builds.sh ../main . hosts --hosts 2 --nproc-per-node 2 --link 10gbit -c all \
#       --sizes 4K,64K,256K,1M,4M,16M --repeats 5
#
# ROUNDS (default 2) alternations; OUT (default docs/bench/ab-<subcommand>.txt in AFTER_DIR) gets every
# run, each headed by its build's commit.
set -euo pipefail
[ $# -ge 3 ] || { sed -n '2,16p' "$0"; exit 2; }
before=$(cd "$1" && pwd); after=$(cd "$2" && pwd); shift 2
for d in "$before" "$after"; do
  ls "$d"/torchdist_ext/_C*.so >/dev/null 2>&1 || { echo "$d has no built extension (python setup.py build_ext --inplace)" >&2; exit 2; }
done
out=${OUT:-$after/docs/bench/ab-$1.txt}
: > "$out"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for d in "$before" "$after"; do
    label=$([ "$d" = "$before" ] && echo before || echo after)
    {
      echo "# round $round, $label: $(git -C "$d" log -1 --format='%h %s' | cut -c1-100)"
      echo "# $(uptime)"
      (cd "$d" && PYTHONPATH="$d" python3 -m torchdist_ext.bench "$@")
      echo
    } | tee -a "$out"
  done
done
echo "# written to $out" >&2
