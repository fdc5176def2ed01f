"""nccl-tests-style benchmark of torch.distributed backends on CPU tensors (tdx against gloo).

Usage::

    python -m torchdist_ext.bench collectives --collective all_reduce --world-size 2 --min-bytes 4K --max-bytes 256M
    tdx-bench collectives --collective all --backends tdx,gloo --json out.json --plot out.png --env TDX_BUFFER_BYTES=16M

Method (results: docs/performance.md). --world-size local processes are spawned with torch.multiprocessing and meet
through a file:// rendezvous in a temporary directory. Each process creates a gloo default group
(used only to exchange results) and then, in turn, one process group per benchmarked backend. For
every size, the backends are measured one after the other, so they see the same machine state and
the ratio column compares like with like. Per (collective, size, backend):

1. one checked iteration with rank-dependent values; a wrong result is reported as WRONG and the
   backend gets no time for that size, so a broken backend cannot produce a fast number;
2. warm-up iterations, then timed iterations: a barrier on the benchmarked group, then one
   synchronous op timed with time.perf_counter. all_gather is all_gather_into_tensor, reduce_scatter
   is reduce_scatter_tensor (all_gather_single / reduce_scatter_single where torch has them), all_to_all
   is all_to_all_single, broadcast is from rank 0;
3. time = max over ranks of the per-rank median; algbw = bytes / time; busbw = algbw * factor,
   factor = 2(n-1)/n for all_reduce, (n-1)/n for all_gather, reduce_scatter and all_to_all, 1 for
   broadcast. bytes is the whole array: the all_reduce tensor, the all_gather output, the
   reduce_scatter input, the all_to_all input (per rank), the broadcast tensor. count = bytes /
   element size.

Iterations shrink for big sizes: min(--iters, --iter-bytes / bytes), at least 5.

Memory-bandwidth ceiling: every rank concurrently copies a --mem-bytes buffer (torch copy_, one
thread per rank); ceiling = bytes read + written by all ranks / time of the slowest rank, best of 10
copies (a ceiling, so the best rather than the median). It is measured before the sweep (used for
the column below) and again after it, to show drift on a shared machine.

tdx mem% (printed for sizes >= 64 MB; smaller working sets partly sit in the last-level cache) is an
ESTIMATE from tdx's algorithms, counting a copy of B bytes as 2B (read + write) and a reduction of k
inputs of B bytes as (k + 1)B. Per rank, for a message of M bytes on n ranks:
all_reduce (reduce-scatter + all-gather path) (5 + 1/n)M: copy into shm 2M, fold own slice M + M/n,
copy all slices out 2M; all_gather (2 + 2/n)M; reduce_scatter (3 - 1/n)M; all_to_all (4 - 2/n)M;
broadcast 2M. The column is n * per-rank traffic / time / ceiling; it ignores write-allocate reads
and cache hits, so read it as "how far from the memory system's limit", not as an exact share.
"""
import argparse
import json
import os
import platform
import re
import shlex
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["main", "parse_size"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
_ALIASES = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
            "all_to_all_single": "all_to_all", "allreduce": "all_reduce", "allgather": "all_gather",
            "alltoall": "all_to_all"}
_DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
_MIN_ITERS = 5
_TRAFFIC_MIN_BYTES = 64 << 20
# torch 2.13 renamed the *_tensor collectives to *_single (same backend calls); older torch has only the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text):
    """Parses "4096", "4K", "1M", "256MB", "1GiB" (binary units) into a number of bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(I?B)?\s*", str(text).upper())
    if not m:
        raise ValueError(f"{text!r} is not a size; use a number of bytes such as 4096, 4K, 1M or 256M")
    return int(m.group(1)) * _UNITS[m.group(2)]


def _human(nbytes):
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes / (1 << 20):.1f}M" if nbytes >= 1 << 20 else str(nbytes)


def busbw_factor(collective, n):
    """nccl-tests bus-bandwidth factor for `collective` on `n` ranks."""
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    return 1.0 if collective == "broadcast" else (n - 1) / n


def tdx_traffic_bytes(collective, nbytes, n):
    """Estimated bytes read + written by all ranks for one tdx op (see the module docstring)."""
    per_rank = {"all_reduce": 5 + 1 / n, "all_gather": 2 + 2 / n, "reduce_scatter": 3 - 1 / n,
                "all_to_all": 4 - 2 / n, "broadcast": 2.0}[collective]
    return n * per_rank * nbytes


def sweep_sizes(collective, args, elem):
    """Sizes from --min-bytes to --max-bytes, rounded down to whole elements (per rank where split)."""
    unit = elem * (1 if collective in ("all_reduce", "broadcast") else args.world_size)
    sizes, b = [], args.min_bytes
    while b <= args.max_bytes:
        s = max(unit, b // unit * unit)
        if not sizes or s != sizes[-1]:
            sizes.append(s)
        b = b * args.step_factor if args.step_factor > 1 else args.max_bytes + 1
    return sizes


def iterations(nbytes, args):
    """(timed, warm-up) iterations for one size: fewer for big sizes, never below _MIN_ITERS timed."""
    iters = max(_MIN_ITERS, min(args.iters, args.iter_bytes // max(nbytes, 1)))
    warmup = max(min(args.warmup, 2), args.warmup * iters // args.iters)
    return iters, warmup


# ---------------------------------------------------------------------------- one benchmark case


def _pattern(count, dtype, offset=0):
    """Rank-dependent values that are exact in every benchmarked dtype (small integers)."""
    return (torch.arange(count, dtype=torch.int32) % 7 + offset).to(dtype)


def make_case(collective, nbytes, rank, n, dtype):
    """Returns (check, run) for one size: check(group) runs one op and returns whether the result is
    right (and leaves the tensors ready for timing); run(group) is the timed op."""
    count = nbytes // torch.empty((), dtype=dtype).element_size()
    if collective == "all_reduce":
        t = torch.empty(count, dtype=dtype)

        def check(g):
            t.copy_(_pattern(count, dtype, rank))
            dist.all_reduce(t, group=g)
            ok = torch.equal(t, (_pattern(count, torch.int64) * n + n * (n - 1) // 2).to(dtype))
            t.zero_()  # timed iterations accumulate in place; zeros keep the values finite
            return ok

        return check, lambda g: dist.all_reduce(t, group=g)
    if collective == "broadcast":
        t = torch.empty(count, dtype=dtype)

        def check(g):
            t.copy_(_pattern(count, dtype, 1)) if rank == 0 else t.zero_()
            dist.broadcast(t, src=0, group=g)
            return torch.equal(t, _pattern(count, dtype, 1))

        return check, lambda g: dist.broadcast(t, src=0, group=g)
    c = count // n  # elements per rank block
    if collective == "all_gather":
        inp, out = _pattern(c, dtype, 8 * rank), torch.empty(count, dtype=dtype)

        def check(g):
            out.zero_()
            _all_gather(out, inp, group=g)
            return torch.equal(out, torch.cat([_pattern(c, dtype, 8 * p) for p in range(n)]))

        return check, lambda g: _all_gather(out, inp, group=g)
    if collective == "reduce_scatter":
        inp, out = _pattern(count, dtype, rank), torch.empty(c, dtype=dtype)

        def check(g):
            out.zero_()
            _reduce_scatter(out, inp, group=g)
            want = _pattern(count, torch.int64)[rank * c:(rank + 1) * c] * n + n * (n - 1) // 2
            return torch.equal(out, want.to(dtype))

        return check, lambda g: _reduce_scatter(out, inp, group=g)
    if collective == "all_to_all":
        inp, out = _pattern(count, dtype, 8 * rank), torch.empty(count, dtype=dtype)

        def check(g):
            out.zero_()
            dist.all_to_all_single(out, inp, group=g)
            block = slice(rank * c, (rank + 1) * c)
            return torch.equal(out, torch.cat([_pattern(count, dtype, 8 * p)[block] for p in range(n)]))

        return check, lambda g: dist.all_to_all_single(out, inp, group=g)
    raise ValueError(f"unknown collective {collective!r}; choose from {', '.join(COLLECTIVES)}")


def time_op(run, group, iters, warmup):
    """Median seconds of `iters` barrier-separated synchronous ops on this rank."""
    for _ in range(warmup):
        run(group)
    times = []
    for _ in range(iters):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        run(group)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _reduce_scalar(x, op):
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=op)  # default (gloo) group: the results channel
    return t.item()


def mem_ceiling(nbytes, reps=10):
    """Concurrent copy bandwidth of all ranks, GB/s: bytes read + written by all ranks / time of the
    slowest rank, best of `reps` barrier-aligned copies (a ceiling, so the best, not the median)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    times = torch.zeros(reps, dtype=torch.float64)
    for i in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dst.copy_(src)
        times[i] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # per copy, the slowest rank
    return 2 * nbytes * dist.get_world_size() / times.min().item() / 1e9


# ---------------------------------------------------------------------------- worker and table


def _row_text(collective, nbytes, count, iters, recs, backends, n, ceiling):
    cells = [f"{nbytes:>12} {_human(nbytes):>5} {count:>11} {iters:>5}"]
    for b in backends:
        r = recs[b]
        if r.get("error"):
            cells.append(f"{r['error'][:28]:>28}")
        else:
            cells.append(f"{r['time_us']:>10.1f} {r['algbw']:>7.2f} {r['busbw']:>7.2f}")
    if len(backends) >= 2:
        a, b = recs[backends[0]], recs[backends[1]]
        ok = not a.get("error") and not b.get("error")
        cells.append(f"{b['time_us'] / a['time_us']:>15.2f}x" if ok else f"{'-':>16}")
    if "tdx" in recs and not recs["tdx"].get("error") and ceiling and nbytes >= _TRAFFIC_MIN_BYTES:
        frac = tdx_traffic_bytes(collective, nbytes, n) / (recs["tdx"]["time_us"] * 1e-6) / 1e9 / ceiling
        recs["tdx"]["traffic_frac"] = frac
        cells.append(f"{100 * frac:>6.0f}%*")
    return "  ".join(cells)


def _table_header(collective, backends, dtype, n):
    cols = f"{'bytes':>12} {'':>5} {'count':>11} {'iters':>5}"
    for b in backends:
        cols += f"  {b + ' time_us':>10} {'algbw':>7} {'busbw':>7}"
    if len(backends) >= 2:
        cols += f"  {backends[0] + '/' + backends[1] + ' speedup':>16}"
    if "tdx" in backends:
        cols += "  tdx mem%*"
    return (f"\n# {collective}  dtype={dtype}  ranks={n}  (time: max over ranks of per-rank median, us;"
            " algbw/busbw in GB/s)\n" + cols)


def _worker(rank, args, tmpdir):
    os.environ.update(dict(kv.split("=", 1) for kv in args.env))
    if args.simulate_hosts > 1:  # consecutive ranks share a simulated host (multi-host mode)
        per_host = -(-args.world_size // args.simulate_hosts)
        os.environ["TDX_NODE_ID"] = f"simhost{rank // per_host}"
    import torchdist_ext  # noqa: F401  registers "tdx" (after the --env knobs are set)

    torch.set_num_threads(args.threads)
    n, dtype = args.world_size, getattr(torch, args.dtype)
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", init_method=f"file://{tmpdir}/rendezvous", rank=rank, world_size=n,
                            timeout=timeout)
    groups = {}
    for b in args.backends:  # one group per backend, created in turn in the same processes
        groups[b] = dist.new_group(backend=b, timeout=timeout)
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    ceiling = mem_ceiling(args.mem_bytes) if args.mem_bytes else 0.0
    if ceiling:
        say(f"# memory-bandwidth ceiling: {ceiling:.1f} GB/s of traffic ({n} ranks each copying "
            f"{_human(args.mem_bytes)} concurrently, bytes read + written / time)")
    records, elem = [], torch.empty((), dtype=dtype).element_size()
    for coll in args.collectives:
        say(_table_header(coll, args.backends, args.dtype, n))
        for nbytes in sweep_sizes(coll, args, elem):
            iters, warmup = iterations(nbytes, args)
            recs = {}
            for b in args.backends:
                rec = {"collective": coll, "backend": b, "bytes": nbytes, "count": nbytes // elem,
                       "dtype": args.dtype, "world_size": n, "iters": iters}
                check, run = make_case(coll, nbytes, rank, n, dtype)
                try:
                    ok, err = check(groups[b]), "WRONG"
                except RuntimeError as e:  # e.g. an op the backend lacks: raised on every rank alike
                    ok, err = False, f"error: {str(e).splitlines()[0]}"
                if _reduce_scalar(ok, dist.ReduceOp.MIN) < 1:
                    rec.update(error=err if not ok else "WRONG (on another rank)", time_us=None,
                               algbw=None, busbw=None)
                else:
                    t = _reduce_scalar(time_op(run, groups[b], iters, warmup), dist.ReduceOp.MAX)
                    rec.update(time_us=t * 1e6, algbw=nbytes / t / 1e9,
                               busbw=nbytes / t / 1e9 * busbw_factor(coll, n))
                recs[b] = rec
                records.append(rec)
                del check, run
            say(_row_text(coll, nbytes, nbytes // elem, iters, recs, args.backends, n, ceiling))
    if ceiling:
        say(f"# memory-bandwidth ceiling measured again after the sweep: {mem_ceiling(args.mem_bytes):.1f} GB/s "
            "(a large difference from the first means the machine's load changed during the run)")
    if any("traffic_frac" in r for r in records):
        say(f"# * tdx mem%: estimated tdx memory traffic (all ranks) / time as a share of the "
            f"{ceiling:.1f} GB/s ceiling; an estimate from a traffic model (see the module docstring)")
    for g in groups.values():
        dist.destroy_process_group(g)
    dist.destroy_process_group()
    if rank == 0:
        with open(os.path.join(tmpdir, "results.json"), "w") as f:
            json.dump({"records": records, "mem_ceiling_GBps": ceiling}, f)


# ---------------------------------------------------------------------------- command line


def _parser():
    p = argparse.ArgumentParser(prog="python -m torchdist_ext.bench collectives", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--collective", "-c", default="all_reduce",
                   help=f"comma list of {', '.join(COLLECTIVES)}, or 'all'")
    p.add_argument("--min-bytes", "-b", default="4K", help="smallest size (4096, 4K, 1M, ...)")
    p.add_argument("--max-bytes", "-e", default="256M", help="largest size")
    p.add_argument("--step-factor", "-f", type=int, default=2, help="multiply the size by this each step")
    p.add_argument("--world-size", "-n", type=int, default=2, help="local processes (ranks) to spawn")
    p.add_argument("--backends", default="tdx,gloo", help="comma list; the first two get a speedup column")
    p.add_argument("--dtype", default="float32", choices=_DTYPES)
    p.add_argument("--iters", type=int, default=100, help="timed iterations at small sizes")
    p.add_argument("--warmup", type=int, default=10, help="warm-up iterations at small sizes")
    p.add_argument("--iter-bytes", default="2G", help="timed iterations shrink to this many bytes per size")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per rank")
    p.add_argument("--mem-bytes", default="256M", help="per-rank copy for the memory ceiling; 0 skips it")
    p.add_argument("--timeout", type=float, default=300, help="process-group timeout, seconds")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VAL",
                   help="environment for the workers, e.g. TDX_BUFFER_BYTES=16M (repeatable)")
    p.add_argument("--simulate-hosts", type=int, default=1, metavar="K",
                   help="split the ranks into K simulated hosts (TDX_NODE_ID per rank) to force tdx's "
                        "multi-host mode: shared memory inside a host, Gloo between hosts")
    p.add_argument("--json", metavar="FILE", help="write the records as a JSON list")
    p.add_argument("--plot", metavar="FILE.png", help="plot time and busbw per size (needs matplotlib)")
    return p


def parse_args(argv=None):
    """Parses and validates the command line; every problem is reported with the offending value."""
    p = _parser()
    args = p.parse_args(argv)
    names = [c.strip() for c in args.collective.split(",") if c.strip()]
    if names == ["all"]:
        names = list(COLLECTIVES)
    names = [_ALIASES.get(c, c) for c in names]
    bad = [c for c in names if c not in COLLECTIVES]
    if bad or not names:
        p.error(f"--collective {args.collective!r}: unknown {bad}; choose from {', '.join(COLLECTIVES)} or 'all'")
    args.collectives = list(dict.fromkeys(names))
    try:
        for k in ("min_bytes", "max_bytes", "iter_bytes", "mem_bytes"):
            setattr(args, k, parse_size(getattr(args, k)))
    except ValueError as e:
        p.error(str(e))
    if not 0 < args.min_bytes <= args.max_bytes:
        p.error(f"--min-bytes {args.min_bytes} and --max-bytes {args.max_bytes}: need 0 < min <= max")
    for k in ("world_size", "iters", "threads", "step_factor"):
        if getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be at least 1, got {getattr(args, k)}")
    if not 1 <= args.simulate_hosts <= args.world_size:
        p.error(f"--simulate-hosts {args.simulate_hosts}: need 1 <= K <= --world-size ({args.world_size})")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    bad = [kv for kv in args.env if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", kv)]
    if bad:
        p.error(f"--env {bad}: use KEY=VAL, e.g. --env TDX_BUFFER_BYTES=16M")
    args.backends = list(dict.fromkeys(b.strip() for b in args.backends.split(",") if b.strip()))
    import torchdist_ext  # noqa: F401  so "tdx" is a known backend

    unknown = [b for b in args.backends if b not in dist.Backend.backend_list or b == "undefined"]
    if unknown or not args.backends:
        p.error(f"--backends {unknown}: not registered; known: {', '.join(dist.Backend.backend_list)}")
    return args


def _require_matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"--plot needs matplotlib ({e}); install it with pip install 'torchdist_ext[bench]' "
                         "or pip install matplotlib, or drop --plot") from None
    return plt


def plot(records, path, title):
    """Time (log-log) and busbw per size, one column per collective, one line per backend."""
    plt = _require_matplotlib()
    colls = list(dict.fromkeys(r["collective"] for r in records))
    fig, axes = plt.subplots(2, len(colls), figsize=(5 * len(colls), 7), squeeze=False)
    for j, coll in enumerate(colls):
        for b in dict.fromkeys(r["backend"] for r in records):
            rs = [r for r in records if r["collective"] == coll and r["backend"] == b and r["time_us"]]
            xs = [r["bytes"] for r in rs]
            axes[0][j].loglog(xs, [r["time_us"] for r in rs], "o-", label=b, base=2)
            axes[1][j].semilogx(xs, [r["busbw"] for r in rs], "o-", label=b, base=2)
        axes[0][j].set(title=coll, ylabel="time (us)")
        axes[1][j].set(xlabel="bytes", ylabel="busbw (GB/s)")
        axes[0][j].legend()
        axes[1][j].grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def main(argv=None):
    """Entry point of `python -m torchdist_ext.bench collectives` (and of the bare command with collective options)."""
    args = parse_args(argv)
    if args.plot:
        _require_matplotlib()  # fail before a long run, not after it
    cmd = "python -m torchdist_ext.bench collectives " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"# {cmd}\n# world_size={args.world_size}  backends={','.join(args.backends)}  dtype={args.dtype}  "
          f"threads/rank={args.threads}  torch {torch.__version__}  cores={cores} ({_cpu_model()})  "
          f"host={platform.node()}  loadavg={os.getloadavg()[0]:.2f}\n# iters={args.iters} (fewer above "
          f"{_human(args.iter_bytes // args.iters)}: iter-bytes={_human(args.iter_bytes)}, min {_MIN_ITERS}), "
          f"warmup={args.warmup}" + (f"  simulated hosts: {args.simulate_hosts}" if args.simulate_hosts > 1 else "")
          + (f"  env: {' '.join(args.env)}" if args.env else ""), flush=True)
    if args.world_size > cores:
        print(f"# warning: {args.world_size} ranks on {cores} cores: ranks share cores, times include "
              "scheduling delays", flush=True)
    os.environ.update(dict(kv.split("=", 1) for kv in args.env))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tdx-bench-") as tmpdir:
        mp.spawn(_worker, args=(args, tmpdir), nprocs=args.world_size, join=True)
        with open(os.path.join(tmpdir, "results.json")) as f:
            result = json.load(f)
    print(f"# elapsed {time.perf_counter() - start:.1f} s  loadavg={os.getloadavg()[0]:.2f} (includes this run)",
          flush=True)
    records = result["records"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(r, mem_ceiling_GBps=result["mem_ceiling_GBps"]) for r in records], f, indent=1)
        print(f"# wrote {len(records)} records to {args.json}")
    if args.plot:
        plot(records, args.plot, cmd)
        print(f"# wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
