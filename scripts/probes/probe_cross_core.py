"""The memory pattern of a 2-rank shared-memory all_reduce without tdx: per-call times and whether the
slow calls come in runs.

    python scripts/probes/probe_cross_core.py --bytes 256K --iters 3000 --copy memmove|torch

Two processes pinned to cores 0 and 1 each own a buffer in shared memory. Every iteration both
write their own buffer at once (glibc's memmove, or torch's vectorized copy_), meet at a flag in
shared memory, then both add the peer's buffer to their own input (torch.add). Each rank prints
p50, p90, the calls slower than 1.3x its median and the median gap between them (1: in runs).
Used for #20's p90 at 256 KB-1 MB (docs/performance.md, "p90 at 256 KB-1 MB").
"""
import argparse
import ctypes
import os
import time

import torch
import torch.multiprocessing as mp

from torchdist_ext.bench.collectives import parse_size


def _rank(rank, bufs, flags, n, iters, copy, out):
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    src, dst = torch.ones(n), torch.empty(n)
    mine, peer = bufs[rank], bufs[1 - rank]
    step = 0

    def meet():
        nonlocal step
        step += 1
        flags[rank] = step
        while flags[1 - rank].item() < step:
            pass

    times = []
    for _ in range(iters):
        meet()
        t0 = time.perf_counter_ns()
        if copy == "memmove":
            ctypes.memmove(mine.data_ptr(), src.data_ptr(), n * 4)
        else:
            mine.copy_(src)
        meet()
        torch.add(src, peer, out=dst)
        times.append(time.perf_counter_ns() - t0)
    out.put((rank, times))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bytes", default="256K")
    p.add_argument("--iters", type=int, default=3000)
    p.add_argument("--copy", choices=("memmove", "torch"), default="memmove")
    args = p.parse_args()
    n = parse_size(args.bytes) // 4
    bufs = [torch.zeros(n).share_memory_() for _ in range(2)]
    flags = torch.zeros(2, dtype=torch.int64).share_memory_()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, bufs, flags, n, args.iters, args.copy, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = dict(out.get(timeout=300) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
    for rank in sorted(results):
        t = torch.tensor(results[rank][100:], dtype=torch.float64) / 1e3
        s = t.sort().values
        p50, p90 = s[len(s) // 2].item(), s[int(len(s) * 0.9)].item()
        slow = (t > 1.3 * p50).nonzero().flatten()
        gap = (slow[1:] - slow[:-1]).double().median().item() if len(slow) > 1 else float("nan")
        print(f"rank {rank} {args.copy} {args.bytes}: p50 {p50:.1f} us, p90 {p90:.1f} ({p90 / p50:.2f}x); "
              f"{len(slow)}/{len(t)} calls over 1.3x the median, median gap between them {gap:.0f}")


if __name__ == "__main__":
    main()
