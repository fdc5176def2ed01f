"""Collectives across real test hosts: tdx against gloo on the same ranks, with each figure's link bound.

Usage::

    python -m torchdist_ext.bench hosts --hosts 2 --nproc-per-node 2 --link 1gbit --sizes 1M,16M --repeats 9
    python -m torchdist_ext.bench hosts -c send_recv --backends tdx,gloo,tcp --link none --sizes 64K,1M,16M

Makes ``--hosts`` test hosts on this machine (``tests/_testhosts.py`` of a source checkout: own
network, UTS, IPC and mount namespaces, private /dev/shm; root needed), limits every host link to ``--link`` in both
directions with ``tc ... tbf`` (``none``: unshaped veth), and runs ``torchrun --nnodes=H`` on every
host. In every repetition each (size, backend) pair takes one turn, in a new seeded order per
repetition; a turn is one checked op, one warm-up op, then ``--iters`` barrier-separated timed
ops whose median (max over ranks) is that repetition's time. The table gives the median (p50) and
the 90th percentile (p90) over the repetitions.

``send_recv`` is a pipeline's stage-to-stage transfer across the link: the last rank of the first host
sends the array to the first rank of the second host, which sends it back (``dist.send`` /
``dist.recv``, an activation and its gradient); the figure is half the round trip, timed by the
sender (a one-way time would count the receiver's late exit from the barrier, or a send that only
filled the socket's buffer). The other ranks wait at the barriers, the default group's for every
backend. Backend ``tcp`` (send_recv only) is the raw link as Python can drive it: the
same two processes, one plain TCP connection between their hosts' addresses, ``sendall`` and
``recv_into`` of the same bytes; a ``b/tcp`` column gives each backend's speed as a share of it. ``--link-bytes`` adds the bytes the first host sent
on its link per timed op (its ``eth0`` counter, median over the repetitions; barriers included).

Link bound: the bytes that must cross the busiest link direction, whatever the algorithm, divided
by the link rate. For H hosts and an array of N bytes (the all_reduce tensor, the all_gather
output, the reduce_scatter input, the broadcast / reduce tensor): all_reduce 2(H-1)/H N,
all_gather and reduce_scatter (H-1)/H N, broadcast, reduce and send_recv N. "% bound" is bound / time.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from .collectives import _human, parse_size

__all__ = ["main", "link_bound_bytes", "checkout_test_module"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")
P2P = ("send_recv",)
RAW = "tcp"  # the raw-link baseline of send_recv


def link_bound_bytes(collective, nbytes, hosts):
    """Bytes that must cross the busiest host link direction for one op (see the module docstring)."""
    h = hosts
    return {"all_reduce": 2 * (h - 1) / h, "all_gather": (h - 1) / h, "reduce_scatter": (h - 1) / h,
            "broadcast": 1.0, "reduce": 1.0, "send_recv": 1.0}[collective] * nbytes


def _percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# ---------------------------------------------------------------------------- one rank


def _case(coll, nbytes, rank, ws, hosts=2):
    """(check(group) -> bool, run(group)) for one collective of `nbytes` fp32 bytes (send_recv: the group
    may be a socket, the backend ``tcp``)."""
    import torch
    import torch.distributed as dist

    if coll == "send_recv":
        return _send_recv_case(nbytes, rank, ws, hosts)

    count = max(ws, nbytes // 4 // ws * ws)
    x = torch.full((count,), float(rank + 1))
    out = torch.empty(count // ws if coll == "reduce_scatter" else count)
    inp = torch.full((count // ws,), float(rank + 1))
    total = ws * (ws + 1) / 2

    def run(g):
        if coll == "all_reduce":
            dist.all_reduce(x, group=g)
        elif coll == "all_gather":
            dist.all_gather_into_tensor(out, inp, group=g)
        elif coll == "reduce_scatter":
            dist.reduce_scatter_tensor(out, x, group=g)
        elif coll == "broadcast":
            dist.broadcast(x, src=0, group=g)
        else:
            dist.reduce(x, dst=0, group=g)

    def check(g):
        x.fill_(rank + 1)
        run(g)
        if coll == "all_reduce":
            return bool((x == total).all())
        if coll == "all_gather":
            return bool((out.view(ws, -1) == torch.arange(1, ws + 1, dtype=out.dtype)[:, None]).all())
        if coll == "reduce_scatter":
            return bool((out == total).all())
        if coll == "broadcast":
            return bool((x == 1).all())
        return rank != 0 or bool((x == total).all())

    return check, run


def _pair(ws, hosts):
    """The two ranks of send_recv: the last rank of the first host and the first of the second."""
    local = ws // hosts
    return local - 1, local


def _send_recv_case(nbytes, rank, ws, hosts):
    """A ping-pong: the array there and back (the receiver sends back what it got); the worker halves
    the time, so a turn's figure is one transfer, both directions' sends timed from the sender."""
    import torch
    import torch.distributed as dist

    src, dst = _pair(ws, hosts)
    x = torch.arange(nbytes // 4, dtype=torch.float32)
    y = torch.empty_like(x)

    def run(g):
        if isinstance(g, _Socket):
            if rank == src:
                g.send(x)
                g.recv(y)
            elif rank == dst:
                g.recv(y)
                g.send(y)
        elif rank == src:
            dist.send(x, dst, group=g)
            dist.recv(y, dst, group=g)
        elif rank == dst:
            dist.recv(y, src, group=g)
            dist.send(y, src, group=g)

    def check(g):
        y.zero_()
        run(g)
        return rank not in (src, dst) or bool(torch.equal(x, y))

    return check, run


class _Socket:
    """One plain TCP connection between the two send_recv ranks, across the hosts' link (the ``tcp``
    baseline). Every rank makes one; only the pair holds a connection."""

    def __init__(self, rank, ws, hosts):
        import socket

        import torch.distributed as dist

        src, dst = _pair(ws, hosts)
        self.sock = None
        addr = [None]
        if rank == dst:
            listener = socket.create_server(("0.0.0.0", 0))
            addr = [(socket.gethostname(), listener.getsockname()[1])]
        dist.broadcast_object_list(addr, src=dst)
        if rank == src:
            self.sock = socket.create_connection(addr[0])
        elif rank == dst:
            self.sock, _ = listener.accept()
            listener.close()
        if self.sock is not None:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, t):
        self.sock.sendall(t.numpy().view("uint8"))

    def recv(self, t):
        view, got = memoryview(t.numpy().view("uint8")), 0
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise RuntimeError("bench hosts: the tcp peer closed the connection")
            got += n

    def close(self):
        if self.sock is not None:
            self.sock.close()


def _tx_bytes():
    """Bytes this network namespace's eth0 has sent (the test host's link)."""
    import subprocess

    out = subprocess.run(["ip", "-j", "-s", "link", "show", "eth0"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)[0]["stats64"]["tx"]["bytes"]


def _worker(args):
    import random

    import torch
    import torch.distributed as dist

    import torchdist_ext  # noqa: F401  registers "tdx"

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    groups = {b: _Socket(rank, ws, args.hosts) if b == RAW else dist.new_group(backend=b) for b in args.backends}
    records = []
    for rep in range(args.repeats):
        turns = [(c, s, b) for c in args.collectives for s in args.sizes for b in args.backends
                 if b != RAW or c in P2P]
        random.Random(rep).shuffle(turns)
        for coll, nbytes, backend in turns:
            g = groups[backend]
            # send_recv: every backend's turn starts at the same barrier (the default group's), so that
            # the backends' own barriers, which release the two hosts at different moments, do not count
            barrier_group = None if coll in P2P else g
            check, run = _case(coll, nbytes, rank, ws, args.hosts)
            ok = torch.tensor([float(check(g))])
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            run(g)
            times = []
            sent = _tx_bytes() if args.link_bytes and rank == 0 else 0
            for _ in range(args.iters):
                dist.barrier(group=barrier_group)
                t0 = time.perf_counter()
                run(g)
                times.append(time.perf_counter() - t0)
            t = torch.tensor([statistics.median(times) / (2 if coll in P2P else 1)])  # send_recv: there and back
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            sent = (_tx_bytes() - sent) / args.iters if args.link_bytes and rank == 0 else None
            records.append({"collective": coll, "bytes": nbytes, "backend": backend, "repeat": rep,
                            "time_s": t.item(), "correct": bool(ok.item()), "link_bytes": sent})
        if rank == 0:
            print(f"repetition {rep + 1}/{args.repeats} done", flush=True)
    if rank == 0:
        with open(args.worker, "w") as f:
            json.dump(records, f)
    for g in groups.values():
        g.close() if isinstance(g, _Socket) else dist.destroy_process_group(g)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- the driver


def _table(records, args, rate):
    lines = []
    for coll in args.collectives:
        backends = [b for b in args.backends if b != RAW or coll in P2P]
        lines.append(f"\n# {coll}: {args.hosts} hosts x {args.nproc_per_node} ranks, link {args.link}, fp32, "
                     f"{args.repeats} repetitions x {args.iters} timed ops, times in ms" + (" (half a round trip)" if coll in P2P else ""))
        head = "size".rjust(8)
        for b in backends:
            head += f" {b + ' p50':>10} {b + ' p90':>10}"
        if "gloo" in backends:
            head += "".join(f" {b + '/gloo':>17}" for b in backends if b != "gloo")
        if RAW in backends:
            head += "".join(f" {b + '/' + RAW:>10}" for b in backends if b != RAW)
        head += f" {'bound':>8}" + "".join(f" {b + ' %bound':>16}" for b in backends) if rate else ""
        head += "".join(f" {b + ' MB/op':>12}" for b in backends) if args.link_bytes else ""
        lines.append(head)
        for nbytes in args.sizes:
            stats = {}
            row = f"{_human(nbytes):>8}"
            for b in backends:
                rs = [r for r in records if r["collective"] == coll and r["bytes"] == nbytes and r["backend"] == b]
                if not all(r["correct"] for r in rs):
                    row += f" {'WRONG':>10} {'':>10}"
                    continue
                ts = [r["time_s"] * 1e3 for r in rs]
                stats[b] = (statistics.median(ts), _percentile(ts, 0.9))
                row += f" {stats[b][0]:10.2f} {stats[b][1]:10.2f}"
            if "gloo" in stats:
                for b in backends:
                    if b != "gloo" and b in stats:
                        row += f" {stats['gloo'][0] / stats[b][0]:7.2f}x/{stats['gloo'][1] / stats[b][1]:.2f}x p90"
            if RAW in stats:
                row += "".join(f" {stats[RAW][0] / stats[b][0]:9.2f}x" for b in backends if b != RAW and b in stats)
            if rate:
                bound = link_bound_bytes(coll, nbytes, args.hosts) / rate * 1e3
                row += f" {bound:8.2f}"
                for b in backends:
                    if b in stats:
                        row += f" {100 * bound / stats[b][0]:7.0f}%/{100 * bound / stats[b][1]:.0f}% p90"
            for b in backends if args.link_bytes else ():
                sent = [r["link_bytes"] for r in records
                        if r["collective"] == coll and r["bytes"] == nbytes and r["backend"] == b]
                row += f" {statistics.median(sent) / 1e6:12.3f}"
            lines.append(row)
    return "\n".join(lines)


def _parser():
    p = argparse.ArgumentParser(prog="python -m torchdist_ext.bench hosts", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hosts", type=int, default=2, help="test hosts to make")
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks per host")
    p.add_argument("--link", default="1gbit", help="tc rate of every host link (1gbit, 10gbit, ...) or none")
    p.add_argument("--collectives", "-c", default="all_reduce",
                   help=f"comma list of {', '.join(COLLECTIVES + P2P)}, or all (the collectives)")
    p.add_argument("--sizes", default="1M,16M", help="comma list of array sizes in bytes (4K, 1M, 16M, ...)")
    p.add_argument("--backends", default="tdx,gloo",
                   help=f"comma list of backends, in the same run ({RAW}: a plain TCP connection, send_recv only)")
    p.add_argument("--repeats", type=int, default=9, help="interleaved repetitions (p50 / p90 over them)")
    p.add_argument("--iters", type=int, default=9,
                   help="timed ops per repetition (their median is its time; with 3, two ops caught in one stall "
                        "of the shared cores set a repetition's time)")
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="extra environment for the ranks")
    p.add_argument("--link-bytes", action="store_true", help="also count the bytes the first host sends per op")
    p.add_argument("--json", help="write the raw records here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p


def parse_args(argv=None):

    args = _parser().parse_args(argv)
    args.collectives = list(COLLECTIVES) if args.collectives == "all" else args.collectives.split(",")
    bad = [c for c in args.collectives if c not in COLLECTIVES + P2P]
    if bad:
        raise SystemExit(f"bench hosts: unknown collective(s) {bad}; choose from {', '.join(COLLECTIVES + P2P)} "
                         "or all")
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    args.backends = args.backends.split(",")
    if RAW in args.backends and not any(c in P2P for c in args.collectives):
        raise SystemExit(f"bench hosts: backend {RAW} is a raw TCP connection for send_recv only; add -c send_recv "
                         f"or drop {RAW} from --backends")
    if args.repeats < 1 or args.iters < 1:
        raise SystemExit("bench hosts: --repeats and --iters must be at least 1")
    return args


def _testhosts():
    """The test-host module of the checkout this package runs from (``tests/_testhosts.py``)."""
    return checkout_test_module("_testhosts", "hosts")


def checkout_test_module(name, bench):
    """``tests/<name>.py`` of the checkout this package runs from, loaded as a module.

    Test hosts (and the etcd cluster on them) are test infrastructure (root, network namespaces), so
    they are not installed with the package; the benchmarks that use them run from a checkout
    (``pip install -e .`` or ``PYTHONPATH``). ``bench`` names the benchmark in the error.
    """
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "tests", f"{name}.py")
    if not os.path.isfile(path):
        raise SystemExit(f"bench {bench}: needs a source checkout of torchdist_ext (tests/{name}.py is not "
                         f"installed; {path} does not exist): run it from a checkout installed with "
                         "`pip install -e .` or with PYTHONPATH=<checkout>")
    tests = os.path.dirname(path)
    if tests not in sys.path:  # its own imports (tests/_apt.py, ...) are siblings, as under pytest
        sys.path.append(tests)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return _worker(args)
    testhosts = _testhosts()
    TestHosts, unavailable_reason = testhosts.TestHosts, testhosts.unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"bench hosts: {reason}")
    rate = None if args.link == "none" else args.link
    with tempfile.TemporaryDirectory(prefix="tdx-bench-hosts-") as tmp, TestHosts(args.hosts, rate=rate) as hosts:
        out = os.path.join(tmp, "records.json")
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds torchdist_ext/
        env = {"PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": 1}
        env.update(dict(kv.split("=", 1) for kv in args.env))
        argv = [a for a in (sys.argv[1:] if argv is None else argv)]
        procs = hosts.torchrun(["-m", "torchdist_ext.bench.hosts", *argv, "--worker", out],
                               nproc_per_node=args.nproc_per_node, env=env, log_dir=tmp)
        print(f"# {args.hosts} test hosts x {args.nproc_per_node} ranks, link {args.link}; "
              f"`python -m torchdist_ext.bench hosts {' '.join(argv)}`", flush=True)
        codes = hosts.wait(procs, timeout=3600)
        if codes != [0] * args.hosts or not os.path.exists(out):
            for h in hosts.hosts:
                print(f"--- {h.name} ---\n{open(os.path.join(tmp, h.name + '.log')).read()[-3000:]}")
            raise SystemExit(f"bench hosts: the ranks failed (exit codes {codes})")
        records = json.load(open(out))
    print(_table(records, args, hosts.link_rate_bytes() if rate else None))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "worker"}, "records": records}, f)


if __name__ == "__main__":
    main()
