"""Runs every collective on backend "tdx" under torchrun and checks each result.

    torchrun --standalone --nproc-per-node=2 examples/collectives_demo.py

Rank 0 prints one line per collective and size with the time it took; the script exits non-zero
if any result differs from what the collective must produce.
"""
import argparse
import time

import torch
import torch.distributed as dist

import torchdist_ext  # noqa: F401  (registers "tdx")


def check(name, ok):
    if not ok:
        raise RuntimeError(f"{name}: result differs from the reference on rank {dist.get_rank()}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-numel", type=int, default=4_000_000, help="largest tensor, in float32 elements")
    args = parser.parse_args()

    dist.init_process_group("tdx")  # rank, world size and rendezvous come from torchrun
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    if rank == 0:
        print(f"tdx demo: {ws} ranks, backend {dist.get_backend()}, torch {torch.__version__}", flush=True)
    numel = 1
    while numel <= args.max_numel:
        timings = {}

        def timed(name, fn):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            timings[name] = (time.perf_counter() - t0) * 1e6

        x = torch.full((numel,), float(rank + 1))
        timed("all_reduce", lambda: dist.all_reduce(x))
        check("all_reduce", torch.all(x == ws * (ws + 1) / 2).item())
        y = torch.full((numel,), 42.0 if rank == 0 else 0.0)
        timed("broadcast", lambda: dist.broadcast(y, src=0))
        check("broadcast", torch.all(y == 42.0).item())
        gathered = torch.empty(numel * ws)
        timed("all_gather", lambda: dist.all_gather_into_tensor(gathered, torch.full((numel,), float(rank))))
        check("all_gather", torch.equal(gathered, torch.arange(ws, dtype=torch.float32).repeat_interleave(numel)))
        out = torch.empty(numel)
        timed("reduce_scatter", lambda: dist.reduce_scatter_tensor(out, torch.ones(numel * ws)))
        check("reduce_scatter", torch.all(out == ws).item())
        if ws > 1:
            got = torch.empty(numel)
            nxt, prv = (rank + 1) % ws, (rank - 1) % ws

            def exchange():
                for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((numel,), float(rank)), nxt),
                                                 dist.P2POp(dist.irecv, got, prv)]):
                    w.wait()

            timed("send/recv", exchange)
            check("send/recv", torch.all(got == prv).item())
        if rank == 0:
            cols = "  ".join(f"{k} {v:9.1f} us" for k, v in timings.items())
            print(f"{numel * 4:>11} bytes  {cols}", flush=True)
        numel *= 16
    dist.barrier()
    if rank == 0:
        print("all collectives matched the reference", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
