"""Parameter servers against synchronous all-reduce DDP, with one worker made slower (a straggler).

    python -m torchdist_ext.bench ps --world-size 4 --servers 1 --plot docs/bench/ps-4rank-2core.png

One job of ``--world-size`` ranks on backend "tdx" trains the same MLP on scikit-learn's digits
(64 features) in each configuration, for ``--seconds`` of wall time each, every configuration
taking one turn per round in a new (seeded) order:

- ``ddp``: torchdist_ext.DistributedDataParallel, every rank trains (the all-reduce anchor; a
  4-byte all-reduce per step lets rank 0's clock stop every rank at the same step);
- ``ps-sync``, ``ssp-2``, ``ssp-4``, ``async``: torchdist_ext.ps with the first ``--servers``
  ranks serving and the others training.

The last rank is the straggler: after each backward it sleeps (``--slowdown`` - 1) times the
compute time it just took, so its steps take ``--slowdown`` times as long. Each worker trains on
its part of the data with random batches of ``--batch`` (after one untimed forward and backward),
SGD with momentum 0.9 at ``--lr`` per applied gradient (synchronous configurations apply the mean
of n gradients per step and take n x ``--lr``, the linear scaling rule);
the first worker (rank 0 under DDP) keeps a copy of its parameters every ``--snapshot`` seconds,
evaluated on the test set after the timed part. Reported per configuration (medians over
rounds): samples/s summed over workers and its ratio to ``ddp`` in the same run, the time until
the test accuracy first reaches ``--target``, the final accuracy, and the staleness of the pushes
(the pushing worker's clock minus the slowest live worker's, server rank 0's histogram).
``--plot FILE`` writes a PNG: test accuracy against wall time (round 1) and the staleness
histograms.
"""
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from torchdist_ext.bench._common import parser, print_command, seeded_order, spawn_ranks

__all__ = ["main"]

CONFIGS = {"ddp": None, "ps-sync": ("sync", 0), "ssp-2": ("ssp", 2), "ssp-4": ("ssp", 4), "async": ("async", 0)}


def _net(width):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, 10))


def _digits():
    from sklearn.datasets import load_digits

    data = load_digits()
    x, y = torch.tensor(data.data, dtype=torch.float32), torch.tensor(data.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    test, train = perm[:360], perm[360:]
    mean, std = x[train].mean(0), x[train].std(0).clamp_min(1e-3)
    x = (x - mean) / std
    return (x[train], y[train]), (x[test], y[test])


def _train(model, opt, data, args, straggler, keep_snapshots, stop):
    """The training loop every worker runs; returns (samples, seconds, [(t, parameter copy)])."""
    xs, ys = data
    g = torch.Generator().manual_seed(dist.get_rank())
    snaps, samples, step = [], 0, 0
    warm = torch.randint(0, len(xs), (args.batch,), generator=g)  # the cold first backward stays off the clock
    torch.nn.functional.cross_entropy(model(xs[warm]), ys[warm]).backward()
    opt.zero_grad()
    t0 = time.perf_counter()
    next_snap = 0.0
    while True:
        now = time.perf_counter() - t0
        if keep_snapshots and now >= next_snap:
            snaps.append((now, [p.detach().clone() for p in model.parameters()]))
            next_snap += args.snapshot
        if stop(now, step):
            break
        idx = torch.randint(0, len(xs), (args.batch,), generator=g)
        c0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xs[idx]), ys[idx]).backward()
        if straggler:
            time.sleep((args.slowdown - 1) * (time.perf_counter() - c0))
        opt.step()
        samples += args.batch
        step += 1
    return samples, time.perf_counter() - t0, snaps


def _lr(args, mode, workers):
    """--lr per applied gradient; a synchronous step applies the mean of ``workers`` gradients, so it
    takes ``workers`` times the rate (the linear scaling rule) unless --no-lr-scaling."""
    return args.lr * workers if mode == "sync" and not args.no_lr_scaling else args.lr


def _run_ddp(args, data, world):
    import torchdist_ext

    rank = dist.get_rank()
    ddp = torchdist_ext.DistributedDataParallel(_net(args.width))
    opt = torch.optim.SGD(ddp.parameters(), lr=_lr(args, "sync", world), momentum=0.9)
    shard = (data[0][rank::world], data[1][rank::world])
    flag = torch.zeros(1)

    def stop(now, step):  # every rank stops at the same step (DDP needs it): rank 0's clock decides
        flag[0] = float(rank == 0 and now >= args.seconds)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() > 0

    samples, secs, snaps = _train(ddp, opt, shard, args, rank == world - 1, rank == 0, stop)
    return {"samples": samples, "seconds": secs, "snaps": snaps, "staleness": None}


def _run_ps(args, data, world, mode, staleness):
    from torchdist_ext import ps

    cfg = ps.PSConfig(num_servers=args.servers, mode=mode, staleness=staleness)
    rank = dist.get_rank()
    if ps.is_server(cfg):
        lr = _lr(args, cfg.effective_mode, world - args.servers)
        stats = ps.serve(_net(args.width), torch.optim.SGD, cfg, lr=lr, momentum=0.9)
        return {"samples": 0, "seconds": 0.0, "snaps": [], "staleness": stats.staleness if rank == 0 else None}
    workers = cfg.worker_ranks(world)
    i = workers.index(rank)
    model = ps.Worker(_net(args.width), cfg)
    shard = (data[0][i::len(workers)], data[1][i::len(workers)])
    out = _train(model, ps.PushOptimizer(model), shard, args, rank == world - 1, i == 0,
                 lambda now, step: now >= args.seconds)
    model.close()
    return {"samples": out[0], "seconds": out[1], "snaps": out[2], "staleness": None}


def _accuracy_curve(snaps, width, test):
    net = _net(width)
    curve = []
    with torch.no_grad():
        for t, params in snaps:
            for p, v in zip(net.parameters(), params):
                p.copy_(v)
            curve.append((t, (net(test[0]).argmax(1) == test[1]).float().mean().item() * 100))
    return curve


def _rank_main(rank, args, tmpdir, results):
    torch.set_num_threads(args.threads)
    dist.init_process_group("tdx", init_method=f"file://{tmpdir}/init", rank=rank, world_size=args.world_size,
                            timeout=timedelta(seconds=600))
    train, test = _digits()
    rows = []
    for r in range(args.rounds):
        for name in seeded_order(list(CONFIGS), r):
            dist.barrier()
            mode = CONFIGS[name]
            out = (_run_ddp(args, train, args.world_size) if mode is None
                   else _run_ps(args, train, args.world_size, *mode))
            out["curve"] = _accuracy_curve(out.pop("snaps"), args.width, test)  # after the timed part
            gathered = [None] * args.world_size
            dist.all_gather_object(gathered, out)
            rows.append((r, name, gathered))
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def _summarize(rows, args):
    """Per configuration: medians over rounds of throughput, time to target, final accuracy."""
    table = {}
    for r, name, gathered in rows:
        workers = [g for g in gathered if g["seconds"] > 0]
        rate = sum(g["samples"] for g in workers) / max(g["seconds"] for g in workers)
        curve = next(g["curve"] for g in gathered if g["curve"])
        hit = next((t for t, a in curve if a >= args.target), None)
        stale = next((g["staleness"] for g in gathered if g["staleness"] is not None), None)
        e = table.setdefault(name, {"rate": [], "hit": [], "final": [], "curve": curve, "stale": stale or {},
                                    "workers": len(workers)})
        e["rate"].append(rate)
        e["hit"].append(hit)
        e["final"].append(curve[-1][1])
    return table


def _buckets(hist):
    """Staleness counts in buckets 0, 1, 2, 3-4, 5-8, 9-16, ... (label, count), up to the largest value."""
    out, lo, hi = [], 0, 0
    top = max(hist) if hist else 0
    while lo <= top:
        label = str(lo) if lo == hi else f"{lo}-{hi}"
        out.append((label, sum(v for k, v in hist.items() if lo <= k <= hi)))
        lo, hi = hi + 1, max(hi + 1, 2 * hi)
    return out


def _print_table(table, args):
    anchor = statistics.median(table["ddp"]["rate"])
    print(f"{'config':>8} {'workers':>7} {'samples/s':>10} {'min-max':>13} {'vs ddp':>7} "
          f"{'t->' + str(args.target) + '% s':>11} "
          f"{'final acc %':>11} {'staleness max':>13} {'mean':>6}")
    for name in CONFIGS:
        e = table[name]
        rate = statistics.median(e["rate"])
        hits = [h for h in e["hit"] if h is not None]
        hit = f"{statistics.median(hits):.2f}" if len(hits) == len(e["hit"]) else f"{len(hits)}/{len(e['hit'])} hit"
        st = e["stale"]
        n = sum(st.values())
        smax = str(max(st)) if st else "-"
        smean = f"{sum(k * v for k, v in st.items()) / n:.2f}" if n else "-"
        spread = f"{min(e['rate']):.0f}-{max(e['rate']):.0f}"
        print(f"{name:>8} {e['workers']:>7} {rate:>10.0f} {spread:>13} {rate / anchor:>6.2f}x {hit:>11} "
              f"{statistics.median(e['final']):>11.2f} {smax:>13} {smean:>6}")
    for name in CONFIGS:
        if table[name]["stale"]:
            shown = ", ".join(f"{label}: {n}" for label, n in _buckets(table[name]["stale"]))
            print(f"# staleness histogram {name} (round 1, server rank 0): {shown}")


def _plot(table, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in CONFIGS:
        t, a = zip(*table[name]["curve"])
        ax1.plot(t, a, label=name)
    ax1.axhline(args.target, color="grey", lw=0.8, ls="--")
    ax1.set(xlabel="wall time (s)", ylabel="test accuracy (%)", ylim=(50, 100),
            title=f"{args.world_size} ranks, {args.servers} server(s), straggler {args.slowdown:g}x slower")
    ax1.legend()
    names = [n for n in CONFIGS if table[n]["stale"]]
    labels = max((_buckets(table[n]["stale"]) for n in names), key=len)
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        counts = [n for _, n in _buckets(table[name]["stale"])]
        ax2.bar([k + j * width for k in range(len(counts))], counts, width, label=name)
    ax2.set_xticks([k + 0.4 - width / 2 for k in range(len(labels))], [label for label, _ in labels],
                   rotation=30)
    ax2.set(xlabel="push staleness (clocks ahead of the slowest worker)", ylabel="pushes",
            yscale="log", title="staleness histogram (server rank 0, round 1)")
    ax2.legend(fontsize=8, loc="upper center")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=90)
    print(f"# plot written to {args.plot}")


def main(argv=None):
    p = parser("ps", __doc__, steps=0, warmup=0, batch=128, world_help="ranks (servers + workers)")
    p.set_defaults(world_size=4)
    p.add_argument("--servers", type=int, default=1, help="the first SERVERS ranks serve (ps configurations)")
    p.add_argument("--seconds", type=float, default=4.0, help="wall time each configuration trains per round")
    p.add_argument("--rounds", type=int, default=2, help="turns each configuration takes (medians over rounds)")
    p.add_argument("--slowdown", type=float, default=3.0, help="the last rank's steps take this many times as long")
    p.add_argument("--width", type=int, default=512, help="hidden width of the MLP")
    p.add_argument("--lr", type=float, default=0.02, help="SGD rate per applied gradient (momentum 0.9)")
    p.add_argument("--no-lr-scaling", action="store_true",
                   help="synchronous configurations use --lr as is (default: --lr x workers, the linear scaling "
                        "rule, since they apply one mean of that many gradients per step)")
    p.add_argument("--target", type=float, default=95.0, help="test accuracy (%%) for the time-to-target column")
    p.add_argument("--snapshot", type=float, default=0.1, help="seconds between parameter snapshots")
    p.add_argument("--plot", default="", help="write accuracy-vs-time and staleness plots to this PNG")
    args = p.parse_args(argv)
    if args.world_size < args.servers + 2:
        p.error(f"--world-size {args.world_size} with --servers {args.servers} leaves fewer than 2 workers "
                "(one straggler and one other)")
    print_command("ps", argv)
    params = sum(t.numel() for t in _net(args.width).parameters())
    print(f"# world_size={args.world_size} servers={args.servers} model=MLP 64-{args.width}-{args.width}-10 "
          f"({params / 1e3:.0f} K params) batch={args.batch}/worker seconds={args.seconds:g} rounds={args.rounds} "
          f"straggler=rank {args.world_size - 1} x{args.slowdown:g} torch {torch.__version__} cores={os.cpu_count()} "
          f"loadavg={os.getloadavg()[0]:.2f}")
    rows = spawn_ranks(_rank_main, args.world_size, args)
    table = _summarize(rows, args)
    _print_table(table, args)
    print(f"# loadavg after: {os.getloadavg()[0]:.2f}")
    if args.plot:
        _plot(table, args)


if __name__ == "__main__":
    main()
