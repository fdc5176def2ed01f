"""What tdx will do: the algorithm each collective takes, by size, in a group of a given shape.

Usage::

    python -m torchdist_ext.bench plan --world-size 4 --nproc-per-node 2 --link 10gbit
    python -m torchdist_ext.bench plan --world-size 8 --sizes 4K,64K,1M --dtype bfloat16

Asks tdx's planner (csrc/tuning/plan.h: one pure function holding every threshold) with this
process's knobs (TDX_XHOST_ALGO, TDX_XHOST_COMPRESS, TDX_XHOST_CHUNK_BYTES, TDX_ONESHOT_BYTES,
TDX_SINGLE_COPY_BYTES, TDX_SHM_STREAM, TDX_BUFFER_BYTES), so setting one on the command line shows
its effect. Nothing is run. ``--link`` is the host link's rate per direction as a group measures it
when it is made (``10gbit``, ``1gbit``, ``500mbit``, or ``unshaped``: a virtual link measured at
about 2 GB/s); only groups spanning hosts use it.

Bytes are those of the all_reduce / reduce / broadcast tensor, the all_gather output, the
reduce_scatter and all_to_all input, a gather's input and a scatter's output.

Columns: ``route`` (shm: one host; sliced: every local rank carries its slice across hosts;
flat: one Gloo operation over all ranks), the shared-memory algorithm on each host, and across
hosts the link algorithm, its form on the link, and the smallest chunk of a chunked transfer.
"""
import argparse
import sys

from .collectives import _human, parse_size

__all__ = ["main", "parse_link", "plan_rows"]

COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "gather", "scatter",
               "all_to_all", "barrier")
DEFAULT_SIZES = "4K,64K,256K,1M,4M,16M"
UNSHAPED_BYTES_PER_SEC = 2e9


def parse_link(text):
    """Bytes per second per direction of ``10gbit``, ``1gbit``, ``500mbit`` or ``unshaped``."""
    t = text.strip().lower()
    if t in ("unshaped", "none"):
        return UNSHAPED_BYTES_PER_SEC
    for suffix, bits in (("gbit", 1e9), ("mbit", 1e6)):
        if t.endswith(suffix):
            try:
                return float(t[: -len(suffix)]) * bits / 8
            except ValueError:
                break
    raise ValueError(f"--link {text!r}: use a rate such as 10gbit, 1gbit or 500mbit, or unshaped")


def plan_rows(collectives, sizes, dtype, op, world_size, hosts, link_bytes_per_sec, uniform=True):
    """[(collective, bytes, plan dict)] from tdx's planner for a group of this shape."""
    from torchdist_ext import _C

    local = -(-world_size // hosts)
    rows = []
    for coll in collectives:
        for nbytes in (sizes if coll != "barrier" else [0]):
            p = _C.tuning.plan(coll, nbytes, dtype=dtype if coll in ("all_reduce", "reduce", "reduce_scatter")
                               else "bytes", redop=op, ranks=world_size, hosts=hosts, local_size=local,
                               uniform=uniform, link_bytes_per_sec=link_bytes_per_sec,
                               amd_cpu=_C.tuning.amd_cpu())
            rows.append((coll, nbytes, p))
    return rows


def main(argv=None):
    """Prints the plan table for the group described by the arguments."""
    ap = argparse.ArgumentParser(prog="python -m torchdist_ext.bench plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=2, help="ranks in the group")
    ap.add_argument("--nproc-per-node", type=int, default=None,
                    help="ranks per host (default: all on one host); the last host may hold fewer")
    ap.add_argument("--link", default="10gbit", help="host link rate per direction (10gbit, 1gbit, unshaped)")
    ap.add_argument("--collective", default="all", help=f"one of {', '.join(COLLECTIVES)}, or all")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated sizes (bytes; K, M, G suffixes)")
    ap.add_argument("--dtype", default="float32", help="dtype of the reductions")
    ap.add_argument("--op", default="sum", help="reduce op of the reductions")
    args = ap.parse_args(argv)
    per_node = args.nproc_per_node or args.world_size
    if args.world_size < 1 or per_node < 1:
        raise SystemExit(f"--world-size {args.world_size} and --nproc-per-node {per_node} must be at least 1")
    hosts = -(-args.world_size // per_node)
    uniform = args.world_size % per_node == 0
    collectives = COLLECTIVES if args.collective == "all" else (args.collective,)
    if any(c not in COLLECTIVES for c in collectives):
        raise SystemExit(f"--collective {args.collective!r}: use one of {', '.join(COLLECTIVES)}, or all")
    try:
        link = parse_link(args.link)
        sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    except ValueError as e:
        raise SystemExit(str(e)) from None
    print("# python -m torchdist_ext.bench plan " + " ".join(sys.argv[2:] if argv is None else argv))
    shape = f"{hosts} host(s) x {per_node} rank(s)" + ("" if uniform else f" (the last host {args.world_size % per_node})")
    print(f"# {args.world_size} ranks on {shape}; link {args.link}; knobs {_knobs()}")
    try:
        rows = plan_rows(collectives, sizes, args.dtype, args.op, args.world_size, hosts, link, uniform)
    except RuntimeError as e:  # an unknown --dtype or --op: the planner names the ones there are
        raise SystemExit(f"python -m torchdist_ext.bench plan: {e}") from None
    print(f"{'collective':<15}{'bytes':>8}  {'route':<7}{'host':<27}{'link':<27}{'on link':<8}chunk")
    for coll, nbytes, p in rows:
        chunk = _human(p["chunk_bytes"]) if p["chunk_bytes"] else "-"
        extra = []
        if p["reduce_as_allreduce"]:
            extra.append("reduce as all_reduce")
        if p["direct_gather"]:
            extra.append("gathered in place")
        if p["route"] == "shm" and p["host"] not in ("-", "single-copy"):
            extra.append(f"{p['stores']} stores")
        print(f"{coll:<15}{_human(nbytes) if coll != 'barrier' else '-':>8}  {p['route']:<7}{p['host']:<27}"
              f"{p['link']:<27}{p['compress']:<8}{chunk}" + (f"  ({', '.join(extra)})" if extra else ""))
    return rows


def _knobs():
    from torchdist_ext import _C

    set_knobs = {k: v for k, v in _C.tuning.knobs().items() if v not in (None, 0, -1, "auto", "none")
                 and k != "shm_half_bytes"}
    return ", ".join(f"{k}={v}" for k, v in set_knobs.items()) or "defaults"
