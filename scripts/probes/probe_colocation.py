"""Probe of the "slow mode" (docs/performance.md): per-iteration times of a 16 KB torch.ops.tdx.all_reduce_ on 2
ranks, with the CPU each rank ran on, unpinned or pinned to cores 0 and 1.

    PYTHONPATH=. python scripts/probes/probe_colocation.py unpinned    # or: pin
"""
import ctypes, os, sys, time, tempfile, torch, torch.distributed as dist, torch.multiprocessing as mp
libc = ctypes.CDLL("libc.so.6"); getcpu = libc.sched_getcpu
PIN = sys.argv[1] == "pin"
def w(rank, d, q):
    if PIN: os.sched_setaffinity(0, {rank})
    import torchdist_ext
    torch.set_num_threads(1)
    dist.init_process_group("tdx", init_method=f"file://{d}/rdv", rank=rank, world_size=2)
    t = torch.zeros(4096); ar = torch.ops.tdx.all_reduce_.default
    for _ in range(500): ar(t)
    rec = []
    for i in range(4000):
        dist.barrier(); c0 = getcpu(); t0 = time.perf_counter(); ar(t); dt = time.perf_counter() - t0; rec.append((dt, c0, getcpu()))
    q.put((rank, rec)); dist.destroy_process_group()
if __name__ == "__main__":
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        ps = [ctx.Process(target=w, args=(r, d, q)) for r in range(2)]
        [p.start() for p in ps]; res = dict(q.get() for _ in ps); [p.join() for p in ps]
    a, b = res[0], res[1]
    times = [max(x[0], y[0]) * 1e6 for x, y in zip(a, b)]
    same = [x[1] == y[1] for x, y in zip(a, b)]
    s = sorted(times); p50, p90 = s[len(s)//2], s[int(.9*len(s))]
    slow = [i for i, t in enumerate(times) if t > 2 * p50]
    print(f"{'pinned' if PIN else 'unpinned'}: p50 {p50:.1f} us p90 {p90:.1f} us; slow (>2x p50) {len(slow)}/{len(times)}; "
          f"both ranks on one cpu: {sum(same)}/{len(same)} overall, {sum(same[i] for i in slow)}/{len(slow)} of the slow ones")
