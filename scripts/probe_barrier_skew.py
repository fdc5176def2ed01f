"""The cross-host barrier on 2 x 2 simulated hosts (TDX_NODE_ID = rank // 2, one machine), tdx
against gloo: latency on rank 0 and how far apart the ranks leave it.

    python scripts/probe_barrier_skew.py [--iters 1000]

Each rank times `dist.barrier(group=g)` and notes CLOCK_MONOTONIC as it leaves (one clock for all
processes of the machine), with a 0.5 ms pause between barriers; printed: the p50 / p90 over the
iterations of the spread between the first and the last rank to leave, how often each rank left
last, and rank 0's p50 latency. The hosts bench times every op after its group's barrier, so a
barrier that releases its ranks far apart puts that spread on the op. Used for #15
(docs/multihost.md, "Gloo p2p on the calling thread").
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(rank, ws, tmp, backend, iters):
    os.environ["TDX_NODE_ID"] = f"simhost{rank // 2}"
    import torch
    import torch.distributed as dist

    import torchdist_ext  # noqa: F401  registers "tdx"

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=rank, world_size=ws)
    g = dist.new_group(backend=backend)
    for _ in range(50):
        dist.barrier(group=g)
    exits, lat = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        dist.barrier(group=g)
        exits.append(time.clock_gettime(time.CLOCK_MONOTONIC))
        lat.append(time.perf_counter() - t0)
        time.sleep(0.0005)
    t = torch.tensor(exits, dtype=torch.float64)
    out = [torch.zeros_like(t) for _ in range(ws)]
    dist.all_gather(out, t)
    if rank == 0:
        m = torch.stack(out)
        spread = (m.max(0).values - m.min(0).values) * 1e6
        last = torch.bincount(m.argmax(0), minlength=ws).tolist()
        print(f"{backend}: exit spread p50 {spread.median().item():.0f} us p90 {spread.quantile(0.9).item():.0f} us; "
              f"last to leave, by rank {last}; rank 0 latency p50 {statistics.median(lat) * 1e6:.0f} us", flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=1000)
    args = p.parse_args()
    sys.path.insert(0, HERE)
    import torch.multiprocessing as mp

    for backend in ("tdx", "gloo", "tdx", "gloo"):
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_worker, args=(4, tmp, backend, args.iters), nprocs=4)


if __name__ == "__main__":
    main()
