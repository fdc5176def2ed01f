"""nccl-tests-style benchmark of CPU collectives: tdx against gloo, MPI and DeepSpeed in one run.

Usage::

    python -m torchdist_ext.bench collectives --collective all_reduce --world-size 2 --min-bytes 4K --max-bytes 256M
    tdx-bench collectives --collective all --backends tdx,tdx-direct,gloo,mpi,deepspeed,noop --json out.json

Columns (--backends; see _columns.py): tdx (dist.* on a tdx group), tdx-direct (torch.ops.tdx.*),
gloo, mpi (mpi4py), deepspeed (torch.ops.deepspeed.inference_all_reduce_), noop (a C++ backend that
does nothing: torch's own cost per dist.* call). mpi, deepspeed and noop are optional extras: a
column whose package is missing is left out with a note. With an mpi column the ranks are one
mpirun launch (mpi4py's COMM_WORLD needs it; as root with --allow-run-as-root), otherwise they are
spawned with torch.multiprocessing; either way every column runs in the same processes.

Method (results: docs/performance.md). The ranks meet through a file:// rendezvous in a temporary
directory; each pins itself to one core (rank r on core r, --no-pin to skip), makes a gloo default
group (used only to exchange results) and one group per torch.distributed column. Per
(collective, size):

1. every column runs one checked op with rank-dependent values; a wrong result is reported as
   WRONG and the column gets no time for that size, so a broken path cannot produce a fast number;
2. the columns take turns over --rounds rounds (order rotated each round), each round giving every
   column iters/rounds timed ops after warm-up; a timed op is a tdx barrier (the same for every
   column), then one synchronous op timed with time.perf_counter. all_gather is
   all_gather_into_tensor, reduce_scatter is reduce_scatter_tensor, all_to_all is
   all_to_all_single, broadcast is from rank 0;
3. p50 and p90 = max over ranks of each rank's percentile over all its samples; algbw = bytes /
   p50; busbw = algbw * factor, factor = 2(n-1)/n for all_reduce, (n-1)/n for all_gather,
   reduce_scatter and all_to_all, 1 for broadcast. bytes is the whole array: the all_reduce tensor,
   the all_gather output, the reduce_scatter input, the all_to_all input, the broadcast tensor.

Iterations shrink for big sizes: min(--iters, --iter-bytes / bytes), at least 5.

Copy rate: every rank copies a --mem-bytes buffer at the same time (torch copy_, one thread per
rank); rate = bytes read + written per process / time of the slowest rank, best of 10 copies. It is
measured before the sweep and again after it, to show drift on a shared machine.

copy% (sizes >= 64 MB, for tdx-direct or else tdx) = the bytes an op must move per rank at least
(its input read once, its output written once: 2M for all_reduce of M bytes, as for a copy of M)
/ p50, as a share of the per-process copy rate. 100% means the op took as long as a plain copy of
its own input to its output. With the `copy` column (each rank copies the op's array, timed in turn
with the other columns) copy% is taken against that column's p50 from 1 MB up instead: the same
machine state as the op, which the rate measured before the sweep need not be.
"""
import argparse
import json
import os
import pickle
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import _columns
from ._cases import make_case, percentile, time_interleaved

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


def min_traffic_bytes(collective, nbytes, n):
    """Bytes one rank must at least read + write in memory for one op, whatever the algorithm: its input
    read once and its output written once (all_reduce and broadcast 2M, all_gather M/n + M,
    reduce_scatter M + M/n, all_to_all 2M for M = the table's bytes). A copy of the same bytes moves as much."""
    per_rank = {"all_reduce": 2.0, "all_gather": 1 + 1 / n, "reduce_scatter": 1 + 1 / n,
                "all_to_all": 2.0, "broadcast": 2.0}[collective]
    return per_rank * nbytes


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


def _cell(r):
    if r.get("error"):
        return f"{r['error'][:26]:>26}"
    return f"{r['p50_us']:>9.1f} {r['p90_us']:>9.1f} {r['busbw']:>6.2f}"


def _tdx_name(recs):
    """The tdx column the anchors are compared with: tdx-direct where it ran, else tdx."""
    for name in ("tdx-direct", "tdx"):
        if name in recs and not recs[name].get("error"):
            return name
    return None


def _row_text(collective, nbytes, iters, recs, columns, n, copy_rate):
    cells = [f"{nbytes:>11} {_human(nbytes):>5} {iters:>5}"] + [_cell(recs[c]) for c in columns]
    ok = lambda c: c in recs and not recs[c].get("error")  # noqa: E731
    if len(columns) >= 2:
        a, b = columns[0], columns[1]
        cells.append(f"{recs[b]['p50_us'] / recs[a]['p50_us']:>8.2f}x" if ok(a) and ok(b) else f"{'-':>9}")
    me, anchors = _tdx_name(recs), [c for c in ("mpi", "deepspeed") if ok(c)]
    if any(c in columns for c in ("mpi", "deepspeed")):
        best = min(anchors, key=lambda c: recs[c]["p50_us"]) if anchors else None
        cells.append(f"{recs[best]['p50_us'] / recs[me]['p50_us']:>7.2f}x {best[:4]:<4}" if me and best
                     else f"{'-':>13}")
    if "noop" in columns:
        cells.append(f"{recs['tdx']['p50_us'] - recs['noop']['p50_us']:>+8.1f}" if ok("tdx") and ok("noop")
                     else f"{'-':>8}")
    if me and ok("copy") and nbytes >= 1 << 20:  # below, both are latency, not memory, bound
        # A copy of the whole array moves 2 x its bytes, timed in turn with the op (same machine state).
        frac = min_traffic_bytes(collective, nbytes, n) / (2 * nbytes) * recs["copy"]["p50_us"] / recs[me]["p50_us"]
        recs[me]["copy_frac"] = frac
        cells.append(f"{100 * frac:>5.0f}%")
    elif me and copy_rate and nbytes >= _TRAFFIC_MIN_BYTES:
        frac = min_traffic_bytes(collective, nbytes, n) / (recs[me]["p50_us"] * 1e-6) / 1e9 / copy_rate
        recs[me]["copy_frac"] = frac
        cells.append(f"{100 * frac:>5.0f}%")
    return "  ".join(cells)


def _table_header(collective, columns, dtype, n):
    cols = f"{'bytes':>11} {'':>5} {'iters':>5}"
    for c in columns:
        cols += f"  {c + ' p50':>9} {'p90':>9} {'busbw':>6}"
    if len(columns) >= 2:
        cols += f"  {columns[1][:4] + '/' + columns[0][:4]:>9}"
    if any(c in columns for c in ("mpi", "deepspeed")):
        cols += f"  {'best/tdx':>13}"
    if "noop" in columns:
        cols += f"  {'tdx-noop':>8}"
    return (f"\n# {collective}  dtype={dtype}  ranks={n}  (p50/p90: max over ranks of each rank's percentile, us;"
            " busbw at p50, GB/s)\n" + cols + "  copy%")


def _pin(rank):
    """Rank r on core r (of the cores this process may use), for every column alike."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})


def _make_columns(rank, args, timeout):
    groups = {"tdx": dist.new_group(backend="tdx", timeout=timeout)}  # also the barrier of every column
    for name in ("gloo", "noop"):
        if name in args.columns:
            if name == "noop":
                _columns.register_noop()
            groups[name] = dist.new_group(backend=name, timeout=timeout)
    cols = {c: _columns.make_column(c, rank, args.world_size, groups) for c in args.columns}
    return cols, groups


def _measure_size(coll, nbytes, rank, args, cols, barrier):
    n, dtype = args.world_size, getattr(torch, args.dtype)
    iters, warmup = iterations(nbytes, args)
    check, run = make_case(coll, nbytes, rank, n, dtype)
    recs, live = {}, {}
    for c, col in cols.items():
        recs[c] = {"collective": coll, "backend": c, "bytes": nbytes, "dtype": args.dtype, "world_size": n,
                   "iters": iters}
        try:
            ok, err = check(col) or c in ("noop", "copy"), "WRONG"  # they compute nothing: only timed
        except NotImplementedError:
            ok, err = False, "n/a"
        except RuntimeError as e:  # e.g. an op the backend lacks: raised on every rank alike
            ok, err = False, f"error: {str(e).splitlines()[0]}"
        if _reduce_scalar(ok, dist.ReduceOp.MIN) < 1:
            recs[c].update(error=err if not ok else "WRONG (on another rank)")
        else:
            live[c] = col
    samples = time_interleaved(run, live, barrier, iters, warmup, args.rounds)
    for c in live:
        p50 = _reduce_scalar(percentile(samples[c], 0.5), dist.ReduceOp.MAX)
        p90 = _reduce_scalar(percentile(samples[c], 0.9), dist.ReduceOp.MAX)
        recs[c].update(p50_us=p50 * 1e6, p90_us=p90 * 1e6, time_us=p50 * 1e6, algbw=nbytes / p50 / 1e9,
                       busbw=nbytes / p50 / 1e9 * busbw_factor(coll, n))
    return iters, recs


def _worker(rank, args, tmpdir):
    os.environ.update(dict(kv.split("=", 1) for kv in args.env))
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    if args.pin:
        _pin(rank)
    if args.simulate_hosts > 1:  # consecutive ranks share a simulated host (multi-host mode)
        per_host = -(-args.world_size // args.simulate_hosts)
        os.environ["TDX_NODE_ID"] = f"simhost{rank // per_host}"
    import torchdist_ext  # noqa: F401  registers "tdx" (after the --env knobs are set)

    torch.set_num_threads(args.threads)
    n = args.world_size
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", init_method=f"file://{tmpdir}/rendezvous", rank=rank, world_size=n,
                            timeout=timeout)
    cols, groups = _make_columns(rank, args, timeout)
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    ceiling = mem_ceiling(args.mem_bytes) if args.mem_bytes else 0.0
    if ceiling:
        say(f"# copy rate: {ceiling / n:.1f} GB/s per process ({n} processes each copying {_human(args.mem_bytes)} "
            f"at once; bytes read + written per process / time; {ceiling:.1f} GB/s together)")
    records, elem = [], torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    barrier = lambda: dist.barrier(group=groups["tdx"])  # noqa: E731
    for coll in args.collectives:
        say(_table_header(coll, args.columns, args.dtype, n))
        for nbytes in sweep_sizes(coll, args, elem):
            iters, recs = _measure_size(coll, nbytes, rank, args, cols, barrier)
            records += recs.values()
            say(_row_text(coll, nbytes, iters, recs, args.columns, n, ceiling / n))
    if ceiling:
        say(f"# copy rate measured again after the sweep: {mem_ceiling(args.mem_bytes) / n:.1f} GB/s per process "
            "(a large difference from the first means the machine's load changed during the run)")
        say("# copy%: the bytes the op must move per rank at least (input read, output written once) / p50, as a "
            "share of the per-process copy rate: 100% is the time of a plain copy of those bytes")
    for g in groups.values():
        dist.destroy_process_group(g)
    dist.destroy_process_group()
    if rank == 0:
        with open(os.path.join(tmpdir, "results.json"), "w") as f:
            json.dump({"records": records, "mem_ceiling_GBps": ceiling}, f)


def _leave():
    """Ends a rank that has written its output and destroyed its groups, without finalizing the
    interpreter (MPI is finalized first where it was loaded, so mpirun sees a clean exit).

    A Gloo worker thread of torch's can release its last Work, and with it tensors' Python objects,
    while the interpreter finalizes (a library that keeps a reference to the default group, such as
    DeepSpeed's comm, keeps the group and its threads alive past destroy_process_group); that thread
    then cannot take the GIL, and the process aborts with "terminate called without an active
    exception" (a core dump showed ProcessGroupGloo::runLoop -> ~AsyncAllreduceWork ->
    decref_pyobject; 2 runs in about 20 with the deepspeed column).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    os._exit(0)


def _spawned_worker(rank, args, tmpdir):
    _worker(rank, args, tmpdir)
    _leave()


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
    p.add_argument("--backends", "--columns", default="tdx,tdx-direct,gloo,mpi,deepspeed",
                   help=f"comma list of columns from {', '.join(_columns.COLUMNS)} (mpi, deepspeed and noop are "
                        "optional extras, left out with a note when not installed); the first two get a ratio column")
    p.add_argument("--rounds", type=int, default=5, help="the columns take turns over this many rounds per size")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin rank r to core r")
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
    asked = list(dict.fromkeys(b.strip() for b in args.backends.split(",") if b.strip()))
    unknown = [b for b in asked if b not in _columns.COLUMNS]
    if unknown or not asked:
        p.error(f"--backends {unknown or asked}: unknown; choose from {', '.join(_columns.COLUMNS)}")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    args.notes = {b: why for b in asked if (why := _columns.available(b))}
    args.columns = [b for b in asked if b not in args.notes]
    if not args.columns:
        p.error(f"--backends {asked}: none can run here ({'; '.join(args.notes.values())})")
    args.backends = args.columns
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
            rs = [r for r in records if r["collective"] == coll and r["backend"] == b and r.get("time_us")]
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


def _launch_mpirun(args, tmpdir):
    """The ranks as one mpirun launch (mpi4py's COMM_WORLD needs it); every column runs in them alike."""
    with open(os.path.join(tmpdir, "args.pkl"), "wb") as f:
        pickle.dump(args, f)
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    # Pinning is the workers' own (rank r on core r, as in the spawn launch), so mpirun binds nothing.
    cmd = ["mpirun", "-np", str(args.world_size), "--bind-to", "none", *root,
           sys.executable, "-m", "torchdist_ext.bench._mpi_rank", tmpdir]
    print(f"# launched as: {shlex.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True)


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
    for b, why in args.notes.items():
        print(f"# column {b} left out: {why}", flush=True)
    with tempfile.TemporaryDirectory(prefix="tdx-bench-") as tmpdir:
        if "mpi" in args.columns:
            _launch_mpirun(args, tmpdir)
        else:
            mp.spawn(_spawned_worker, args=(args, tmpdir), nprocs=args.world_size, join=True)
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
