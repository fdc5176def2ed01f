"""The CPU time of one direct op (`torch.ops.tdx.*`) and one `dist.all_reduce` on a one-rank tdx
group, where a call has no peer to wait for: what each call costs in itself (torch's dispatch, the
group's resolution, the backend's checks, route and Work), measured as this thread's CPU time, so
other jobs on the machine move it little.

    PYTHONPATH=CHECKOUT taskset -c 0 python scripts/probes/probe_direct_percall.py

Prints the median over 15 blocks of 5000 calls of a 4 KB float32 tensor, in microseconds per call.
Run it from two checkouts in turn to compare builds (docs/performance.md, "Small and large messages").
"""
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import torchdist_ext  # noqa: F401  registers "tdx" and torch.ops.tdx


def main():
    torch.set_num_threads(1)
    dist.init_process_group("tdx", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    t, out = torch.ones(1024), torch.empty(1024)
    name = dist.group.WORLD.group_name
    calls = {"all_reduce_ ''": lambda: torch.ops.tdx.all_reduce_(t),
             "all_reduce_ by name": lambda: torch.ops.tdx.all_reduce_(t, "sum", name),
             "all_gather_into_tensor_ ''": lambda: torch.ops.tdx.all_gather_into_tensor_(out, t),
             "reduce_scatter_tensor_ ''": lambda: torch.ops.tdx.reduce_scatter_tensor_(out, t),
             "dist.all_reduce": lambda: dist.all_reduce(t)}
    res = {}
    for label, fn in calls.items():
        for _ in range(2000):
            fn()
        blocks = []
        for _ in range(15):
            t0 = time.thread_time()
            for _ in range(5000):
                fn()
            blocks.append((time.thread_time() - t0) / 5000 * 1e6)
        res[label] = statistics.median(blocks)
    print("  ".join(f"{k}: {v:.2f} us" for k, v in res.items()), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
