"""Where a collective's p90 comes from: per-call times of one size on 2 pinned ranks, and whether the
slow calls come alone or in runs.

    python scripts/probes/probe_p90.py --bytes 1M --iters 5000 [--op all_reduce|copy] [--barrier]

Each rank (pinned to core `rank`) runs `--iters` calls of `torch.ops.tdx.all_reduce_` on a tdx
group (or, with `--op copy`, a plain copy of the same bytes, no communication) and prints p50, p90,
p99, the calls slower than 1.3x the median and the median gap between them (1: they come in runs).
With `--barrier` a tdx barrier precedes every timed call, as in the collectives benchmark.
"""
import argparse
import os
import queue
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchdist_ext.bench.collectives import parse_size


def _rank(rank, ws, path, nbytes, iters, op, barrier, out):
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    import torchdist_ext  # noqa: F401  (registers tdx and torch.ops.tdx)

    dist.init_process_group("tdx", init_method=f"file://{path}", rank=rank, world_size=ws)
    x = torch.ones(nbytes // 4)
    y = torch.empty_like(x)
    call = (lambda: y.copy_(x)) if op == "copy" else (lambda: torch.ops.tdx.all_reduce_(x))
    for _ in range(200):
        call()
    times, starts = [], []
    for _ in range(iters):
        for _ in range(barrier):
            dist.barrier()
        t0 = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - t0)
        starts.append(t0)
    dist.barrier()
    out.put((rank, (times, starts)))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bytes", default="1M", help="message size (4K, 1M, ...)")
    p.add_argument("--iters", type=int, default=5000)
    p.add_argument("--op", choices=("all_reduce", "copy"), default="all_reduce")
    p.add_argument("--barrier", action="count", default=0,
                   help="a tdx barrier before every timed call (twice: two barriers)")
    args = p.parse_args()
    nbytes = parse_size(args.bytes)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    path = tempfile.mktemp(prefix="tdx-probe-")
    procs = [ctx.Process(target=_rank, args=(r, 2, path, nbytes, args.iters, args.op, args.barrier, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = {}
    try:
        while len(results) < len(procs):
            rank, times = out.get(timeout=120)
            results[rank] = times
    except queue.Empty:
        raise SystemExit(f"probe_p90: no result from ranks {sorted(set(range(2)) - set(results))} in 120 s "
                         "(see their tracebacks above)")
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    starts = {rank: torch.tensor(v[1], dtype=torch.float64) / 1e3 for rank, v in results.items()}
    results = {rank: v[0] for rank, v in results.items()}
    # perf_counter_ns is CLOCK_MONOTONIC, shared by the ranks: how far apart the calls started.
    skew = (starts[0] - starts[1]).abs()
    slow_any = torch.zeros(len(skew), dtype=torch.bool)
    for rank, times in sorted(results.items()):
        t = torch.tensor(times, dtype=torch.float64)
        slow_any |= t > 1.3 * t.median()
    fast = ~slow_any
    print(f"start skew between the ranks: median {skew.median().item():.1f} us over all calls; "
          f"{skew[slow_any].median().item() if slow_any.any() else float('nan'):.1f} us in the slow calls, "
          f"{skew[fast].median().item():.1f} us in the others")
    for rank, times in sorted(results.items()):
        t = torch.tensor(times, dtype=torch.float64) / 1e3
        s = t.sort().values
        p50, p90, p99 = (s[int(len(s) * q)].item() for q in (0.5, 0.9, 0.99))
        slow = (t > 1.3 * p50).nonzero().flatten()
        gap = (slow[1:] - slow[:-1]).double().median().item() if len(slow) > 1 else float("nan")
        slow_p50 = t[slow].median().item() if len(slow) else float("nan")
        print(f"rank {rank} {args.op} {args.bytes}: p50 {p50:.1f} us, p90 {p90:.1f} ({p90 / p50:.2f}x), p99 {p99:.1f}; "
              f"{len(slow)}/{len(t)} calls over 1.3x the median (their median {slow_p50:.1f} us), median gap "
              f"between them {gap:.0f}")


if __name__ == "__main__":
    main()
