"""Parameter servers with and without replicated shards: what a replica costs per push.

    python -m torchdist_ext.bench ps-replicas --world-size 4 --servers 2 --steps 200 --rounds 3

One job of ``--world-size`` ranks on backend "tdx": the first ``--servers`` ranks serve, the others
train an MLP 64-``--width``-``--width``-10 on random batches. Each consistency mode ("sync",
"async", "ssp" with s = 1) runs once with ``PSConfig(replicate=False)`` and once with
``replicate=True`` per round, the configurations interleaved in a seeded order per round. A worker
times each ``step()`` (the push until every copy acknowledged it and the pull landed; the
forward and backward are off the clock) and counts the bytes it sends and receives per step
(``Worker.traffic``). Reported per mode: the median push time over rounds and workers with and
without replicas and their ratio, and the bytes per push.
"""
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from torchdist_ext.bench._common import parser, print_command, seeded_order, spawn_ranks
from torchdist_ext.bench.ps import _net

__all__ = ["main"]

MODES = ("sync", "async", "ssp")


def _run_worker(cfg, args):
    from torchdist_ext import ps

    model = ps.Worker(_net(args.width), cfg)
    opt = ps.PushOptimizer(model)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(args.batch, 64, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    times = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            start = dict(model.traffic)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        t0 = time.perf_counter()
        opt.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    model.close()
    return (statistics.median(times), (model.traffic["sent"] - start["sent"]) / args.steps,
            (model.traffic["received"] - start["received"]) / args.steps)


def _rank_main(rank, args, tmp, results):
    import torchdist_ext  # noqa: F401  (registers "tdx")
    from torchdist_ext import ps

    torch.set_num_threads(args.threads)
    dist.init_process_group("tdx", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=args.world_size,
                            timeout=timedelta(seconds=120))
    rows = []
    for rnd in range(args.rounds):
        for mode, replicate in seeded_order([(m, r) for m in MODES for r in (False, True)], rnd):
            cfg = ps.PSConfig(num_servers=args.servers, mode=mode, staleness=1 if mode == "ssp" else 0,
                              replicate=replicate)
            if ps.is_server(cfg):
                ps.serve(_net(args.width), torch.optim.SGD, cfg, lr=0.01)
            else:
                rows.append((rnd, mode, replicate, rank, *_run_worker(cfg, args)))
    gathered = [None] * args.world_size
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        results.put([r for part in gathered for r in part])
    dist.destroy_process_group()


def main(argv=None):
    p = parser("ps-replicas", __doc__, steps=200, warmup=20, batch=64, world_help="ranks (servers + workers)")
    p.set_defaults(world_size=4)
    for flag, default, what in (("--servers", 2, "the first SERVERS ranks serve (at least 2)"),
                                ("--rounds", 3, "turns each configuration takes"),
                                ("--width", 512, "hidden width of the MLP")):
        p.add_argument(flag, type=int, default=default, help=what)
    args = p.parse_args(argv)
    if args.servers < 2 or args.world_size < args.servers + 1:
        p.error(f"--servers {args.servers} --world-size {args.world_size}: a replica needs 2 servers or more and "
                "the job at least one worker")
    print_command("ps-replicas", argv)
    params = sum(t.numel() for t in _net(args.width).parameters())
    print(f"# world_size={args.world_size} servers={args.servers} model=MLP 64-{args.width}-{args.width}-10 "
          f"({params / 1e3:.0f} K params) batch={args.batch}/worker steps={args.steps} rounds={args.rounds} "
          f"torch {torch.__version__} cores={os.cpu_count()} loadavg={os.getloadavg()[0]:.2f}")
    rows = spawn_ranks(_rank_main, args.world_size, args)
    print("# raw: round mode replicate worker push_ms sent_B/push received_B/push")
    for rnd, mode, rep, rank, t, sent, recv in sorted(rows):
        print(f"{rnd} {mode} {int(rep)} {rank} {t * 1e3:.3f} {sent:.0f} {recv:.0f}")
    print("| mode | push ms, no replica | with replicas | ratio (min-max over rounds) | B sent per push | "
          "with replicas | B received | with replicas |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for mode in MODES:
        def pick(rep, col, rnd=None):
            return [r[col] for r in rows if r[1] == mode and r[2] == rep and (rnd is None or r[0] == rnd)]
        plain, repl = statistics.median(pick(False, 4)), statistics.median(pick(True, 4))
        ratios = [statistics.median(pick(True, 4, k)) / statistics.median(pick(False, 4, k)) for k in range(args.rounds)]
        print(f"| {mode} | {plain * 1e3:.2f} | {repl * 1e3:.2f} | {repl / plain:.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) "
              f"| {statistics.median(pick(False, 5)):.0f} | {statistics.median(pick(True, 5)):.0f} "
              f"| {statistics.median(pick(False, 6)):.0f} | {statistics.median(pick(True, 6)):.0f} |")
    print(f"# loadavg after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
