"""Cross-host probes on 2 x 2 simulated hosts (TDX_NODE_ID = rank // 2, one machine), tdx against
gloo, alternating (tdx, gloo, tdx, gloo). Used for #15 (docs/multihost.md, "Gloo p2p on the
calling thread").

    python scripts/probes/probe_simhosts.py broadcast [--bytes 64K] [--call dist|backend] [--iters 2000]
    python scripts/probes/probe_simhosts.py barrier [--iters 1000]

broadcast: back-to-back broadcasts from rank 0, no barrier between them; printed: each rank's p50.
`--call dist` times `dist.broadcast`; `backend` calls the group's CPU backend directly
(`group._get_backend(cpu).broadcast(...).wait()`), without torch's Python and dispatcher path.
Run it under `perf stat -e context-switches` to count the context switches (startup included).

barrier: each rank times `dist.barrier(group=g)` and notes CLOCK_MONOTONIC as it leaves (one clock
for all processes of the machine), with a 0.5 ms pause between barriers; printed: the p50 / p90 over
the iterations of the spread between the first and the last rank to leave, how often each rank left
last, and rank 0's p50 latency. The hosts bench times every op after its group's barrier, so a
barrier that releases its ranks far apart puts that spread on the op.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout


def _broadcast(dist, torch, g, rank, ws, backend, args):
    x = torch.ones(args.nbytes // 4)
    if args.call == "backend":
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
    for _ in range(args.iters):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    med = torch.tensor([statistics.median(times) * 1e6])
    meds = [torch.zeros(1) for _ in range(ws)]
    dist.all_gather(meds, med)
    if rank == 0:
        print(f"{backend} {args.call} {args.nbytes} B: p50 per rank (us) {[round(m.item()) for m in meds]}",
              flush=True)


def _barrier(dist, torch, g, rank, ws, backend, args):
    for _ in range(50):
        dist.barrier(group=g)
    exits, lat = [], []
    for _ in range(args.iters):
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


def _worker(rank, ws, tmp, backend, args):
    os.environ["TDX_NODE_ID"] = f"simhost{rank // 2}"
    import torch
    import torch.distributed as dist

    import torchdist_ext  # noqa: F401  registers "tdx"

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=rank, world_size=ws)
    g = dist.new_group(backend=backend)
    (_broadcast if args.what == "broadcast" else _barrier)(dist, torch, g, rank, ws, backend, args)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    b = sub.add_parser("broadcast", help="back-to-back broadcasts: each rank's p50")
    b.add_argument("--bytes", default="64K")
    b.add_argument("--call", default="dist", choices=["dist", "backend"])
    b.add_argument("--iters", type=int, default=2000)
    r = sub.add_parser("barrier", help="barrier latency and exit spread")
    r.add_argument("--iters", type=int, default=1000)
    args = p.parse_args()
    sys.path.insert(0, HERE)
    import torch.multiprocessing as mp

    if args.what == "broadcast":
        from torchdist_ext.bench.collectives import parse_size

        args.nbytes = parse_size(args.bytes)
    for backend in ("tdx", "gloo", "tdx", "gloo"):
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_worker, args=(4, tmp, backend, args), nprocs=4)


if __name__ == "__main__":
    main()
