"""A cross-host broadcast on tdx, on torch's Gloo group and on a raw ProcessGroupGloo, side by side:
per-rank p50 / p90 of one size on 2 test hosts x 2 ranks.

    python scripts/probes/probe_xhost_broadcast.py [--link 1gbit|none] [--bytes 64K] [--iters 200]

Each iteration runs, for each column (in alternating order), a barrier on that group and one timed
broadcast from rank 0: `dist.broadcast` on the tdx group and on `new_group(backend="gloo")`, and
`ProcessGroupGloo.broadcast(...).wait()` called directly on a Gloo group made as tdx makes its own
(what torch's Python and dispatcher path add). `--barrier raw|gloo` puts one group's barrier before
all of them instead: a group whose Gloo threads have just run is quicker. `--extra` adds three
columns: `tdx-backend`, tdx's c10d backend called directly (`group._get_backend(cpu).broadcast(...)
.wait()`, no torch Python or dispatcher); `tdx-gloo`, the Gloo group tdx itself made for the
cross-host part, called from Python (Gloo's operation without tdx around it); and `raw-p2p`, the
root sending to every rank with Gloo's p2p on a raw Gloo group (what tdx's flat broadcast does).
Used for #15's small broadcast (docs/multihost.md, "Not done").
TDX_* variables set for the probe reach the ranks (TDX_XHOST_ALGO=flat times the flat route, which
two hosts no longer take by themselves).
Needs the test hosts (root, network namespaces): see tests/_testhosts.py.
"""
import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout


def _worker(nbytes, iters, barrier, extra):
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    import torchdist_ext  # noqa: F401  registers "tdx"
    from torchdist_ext import _backend

    made = []  # the Gloo groups tdx makes for its cross-host part (all ranks, slice)
    if extra:
        make_gloo_groups = _backend._gloo_groups

        def keep_gloo_groups(*args, **kwargs):
            made.append(make_gloo_groups(*args, **kwargs))
            return made[-1]

        _backend._gloo_groups = keep_gloo_groups
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    groups = {b: dist.new_group(backend=b) for b in ("tdx", "gloo")}
    groups["raw"] = dist.ProcessGroupGloo(dist.PrefixStore("probe/raw/", _get_default_store()), rank, ws,
                                          datetime.timedelta(seconds=60))
    if extra:
        groups["tdx-backend"] = groups["tdx"]._get_backend(torch.device("cpu"))
        groups["tdx-gloo"] = made[-1][0]
        groups["raw-p2p"] = dist.ProcessGroupGloo(dist.PrefixStore("probe/p2p/", _get_default_store()), rank, ws,
                                                  datetime.timedelta(seconds=60))
    direct = ("raw", "tdx-backend", "tdx-gloo")  # called as Backend.broadcast(...).wait()
    x = torch.ones(nbytes // 4)
    times = {b: [] for b in groups}
    for it in range(iters):
        order = list(groups.items())
        for b, g in (order if it % 2 else reversed(order)):
            if barrier == "raw":
                groups["raw"].barrier().wait()
            elif barrier == "gloo":
                dist.barrier(group=groups["gloo"])
            if b == "raw-p2p":  # the root sends to every rank with Gloo's p2p, on the calling thread
                if barrier == "own":
                    g.barrier().wait()
                t0 = time.perf_counter()
                if rank == 0:
                    for w in [g.send([x], r, 7) for r in range(1, ws)]:
                        w.wait()
                else:
                    g.recv([x], 0, 7).wait()
            elif b in direct:
                if barrier == "own":
                    g.barrier().wait()
                o = dist.BroadcastOptions()
                o.rootRank = 0
                o.asyncOp = False  # as dist.broadcast sets it (tdx runs a synchronous call inline)
                t0 = time.perf_counter()
                g.broadcast([x], o).wait()
            else:
                if barrier == "own":
                    dist.barrier(group=g)
                t0 = time.perf_counter()
                dist.broadcast(x, 0, group=g)
            times[b].append(time.perf_counter() - t0)
    cols = " ".join(f"{b} p50 {statistics.median(v) * 1e3:.3f} p90 {sorted(v)[int(0.9 * len(v))] * 1e3:.3f}"
                    for b, v in times.items())
    print(f"rank {rank} ({os.uname().nodename}) ms: {cols}", flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link", default="1gbit", help="tc tbf rate of the host links, or none")
    p.add_argument("--bytes", default="64K")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--barrier", default="own", choices=["own", "raw", "gloo"],
                   help="the barrier before each timed call: each group's own (default), or the raw Gloo "
                        "group's or torch's Gloo group's for all three")
    p.add_argument("--extra", action="store_true",
                   help="also time tdx's backend called directly and tdx's own cross-host Gloo group")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path[:0] = [HERE, os.path.join(HERE, "tests")]
    from torchdist_ext.bench.collectives import parse_size

    nbytes = parse_size(args.bytes)
    if args.worker:
        return _worker(nbytes, args.iters, args.barrier, args.extra)
    from _testhosts import TestHosts, unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"probe_xhost_broadcast: {reason}")
    rate = None if args.link == "none" else args.link
    with tempfile.TemporaryDirectory() as tmp, TestHosts(2, rate=rate) as hosts:
        env = {"PYTHONPATH": HERE, "OMP_NUM_THREADS": 1}
        env.update({k: v for k, v in os.environ.items() if k.startswith("TDX_")})  # e.g. TDX_XHOST_ALGO=sliced
        procs = hosts.torchrun([os.path.abspath(__file__), "--worker", "--bytes", args.bytes, "--iters",
                                str(args.iters), "--barrier", args.barrier] + (["--extra"] if args.extra else []),
                                nproc_per_node=2, env=env, log_dir=tmp)
        codes = hosts.wait(procs, timeout=600)
        for h in hosts.hosts:
            log = open(os.path.join(tmp, h.name + ".log")).read()
            lines = [line for line in log.splitlines() if line.startswith("rank ")]
            print("\n".join(lines) if codes == [0] * len(codes) else log[-3000:])


if __name__ == "__main__":
    main()
