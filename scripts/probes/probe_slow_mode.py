"""Probe of the >= 1 MB "slow mode" (docs/performance.md): in one pair of pinned ranks, alternates 1 MB
torch.ops.tdx.all_reduce_ with a plain local 1 MB copy of the same size, and reports per block the median of
each, the minor page faults taken and the page offsets of the tensors, and a 4 KB all_reduce (one cache-line round trip), so a slow block says whether memory
itself was slow (the copy slows too) or only the exchange.

    PYTHONPATH=. python scripts/probes/probe_slow_mode.py [blocks] [MB]
"""
import os, sys, tempfile, time, torch, torch.distributed as dist, torch.multiprocessing as mp

BLOCKS = int(sys.argv[1]) if len(sys.argv) > 1 else 10
MB = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0


def minflt():
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def sched():
    """(ns run, ns runnable but waiting for the core, voluntary, involuntary context switches) of this thread."""
    with open("/proc/thread-self/schedstat") as f:
        run, wait, _ = map(int, f.read().split())
    with open("/proc/thread-self/status") as f:
        sw = dict(line.split(":") for line in f if "ctxt_switches" in line)
    return run, wait, int(sw["voluntary_ctxt_switches"]), int(sw["nonvoluntary_ctxt_switches"])


def steal(cpu):
    """Jiffies the hypervisor ran something else while this virtual CPU wanted to run (/proc/stat steal)."""
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith(f"cpu{cpu} "):
                return int(line.split()[8])


def w(rank, d, q):
    os.sched_setaffinity(0, {rank})
    import torchdist_ext  # noqa: F401
    torch.set_num_threads(1)
    dist.init_process_group("tdx", init_method=f"file://{d}/rdv", rank=rank, world_size=2)
    n = int(MB * (1 << 20)) // 4
    t, a, b, s = torch.ones(n), torch.ones(n), torch.empty(n), torch.ones(1024)
    ar = torch.ops.tdx.all_reduce_.default
    for _ in range(20):
        ar(t, "sum", dist.group.WORLD.group_name)
    rows = []
    for blk in range(BLOCKS):
        f0, s0, st0, w0 = minflt(), sched(), steal(rank), time.perf_counter(); ta, tc, ts = [], [], []
        for _ in range(30):
            dist.barrier(); t0 = time.perf_counter(); ar(s, "sum", dist.group.WORLD.group_name)
            ts.append(time.perf_counter() - t0)
            dist.barrier(); t0 = time.perf_counter(); ar(t, "sum", dist.group.WORLD.group_name)
            ta.append(time.perf_counter() - t0)
            t0 = time.perf_counter(); b.copy_(a); tc.append(time.perf_counter() - t0)
        ds = [b - a for a, b in zip(s0, sched())]
        rows.append((sorted(ta)[15] * 1e6, sorted(tc)[15] * 1e6, sorted(ts)[15] * 1e6, minflt() - f0,
                     ds[1] / 90e3, ds[2], ds[3], (steal(rank) - st0) / 100 / (time.perf_counter() - w0) * 100))
    q.put((rank, rows, t.data_ptr() % 4096, a.data_ptr() % 4096, b.data_ptr() % 4096))
    dist.destroy_process_group()


if __name__ == "__main__":
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        ps = [ctx.Process(target=w, args=(r, d, q)) for r in range(2)]
        [p.start() for p in ps]; res = {r: rest for r, *rest in (q.get() for _ in ps)}; [p.join() for p in ps]
    for r in (0, 1):
        rows, *offs = res[r]
        print(f"rank {r} page offsets (t, a, b): {offs}")
        print("  per block: all_reduce p50 us / local copy p50 us / 4 KB all_reduce p50 us / minor faults / "
              "us waiting for the core per op / voluntary / involuntary switches / steal % of the block")
        for row in rows:
            print("    %6.0f %5.0f %5.1f %4d %8.1f %5d %5d %5.0f%%" % row)
