"""Back-to-back broadcasts on 2 x 2 simulated hosts (TDX_NODE_ID = rank // 2, one machine), tdx
against gloo: per-rank p50 of 2000 timed calls of one size, no barrier between them.

    python scripts/probe_back_to_back_broadcast.py [--bytes 64K] [--call dist|backend]

`--call dist` times `dist.broadcast`; `backend` calls the group's CPU backend directly
(`group._get_backend(cpu).broadcast(...).wait()`), without torch's Python and dispatcher path.
Run it under `perf stat -e context-switches` to count the context switches (startup included).
Used for #15's small broadcast (docs/multihost.md).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(rank, ws, tmp, backend, nbytes, call):
    os.environ["TDX_NODE_ID"] = f"simhost{rank // 2}"
    import torch
    import torch.distributed as dist

    import torchdist_ext  # noqa: F401  registers "tdx"

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=rank, world_size=ws)
    g = dist.new_group(backend=backend)
    x = torch.ones(nbytes // 4)
    if call == "backend":
        be = g._get_backend(torch.device("cpu"))
        o = dist.BroadcastOptions()
        o.rootRank = 0
        o.asyncOp = False

        def run():
            be.broadcast([x], o).wait()
    else:
        def run():
            dist.broadcast(x, 0, group=g)
    for _ in range(50):
        run()
    dist.barrier(group=g)
    times = []
    for _ in range(2000):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    med = torch.tensor([statistics.median(times) * 1e6])
    meds = [torch.zeros(1) for _ in range(ws)]
    dist.all_gather(meds, med)
    if rank == 0:
        print(f"{backend} {call} {nbytes} B: p50 per rank (us) {[round(m.item()) for m in meds]}", flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bytes", default="64K")
    p.add_argument("--call", default="dist", choices=["dist", "backend"])
    args = p.parse_args()
    sys.path.insert(0, HERE)
    import torch.multiprocessing as mp

    from torchdist_ext.bench.collectives import parse_size

    for backend in ("tdx", "gloo"):
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_worker, args=(4, tmp, backend, parse_size(args.bytes), args.call), nprocs=4)


if __name__ == "__main__":
    main()
