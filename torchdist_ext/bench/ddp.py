"""Step-time benchmark of torchdist_ext.DistributedDataParallel against torch's DDP.

    python -m torchdist_ext.bench ddp --world-size 2
    python -m torchdist_ext.bench ddp --world-size 2 --bucket-mb 1,5,25   # bucket-size sweep

Every configuration runs in the same worker processes on the same model and data, so the ratios
compare like with like (see docs/performance.md): ours on tdx, torch's DDP on tdx, torch's DDP on gloo, ours on
gloo. Every (bucket size, configuration) pair takes one turn in each of `--rounds` rounds, in a new
(seeded) order each round, so a slow spell of the machine, the colder first turns of a process and
the state a turn leaves to the next hit all of them alike; a configuration's time is the median over rounds of (max over ranks of
the per-rank median step time after warm-up), with a barrier before each timed step.

Models: the default MLP (wide Linear layers, a small batch) has a small compute per parameter,
but its local step (forward and backward reading every weight, the optimizer) still takes most of
our step; ``--model embedding`` (a bag-of-words classifier: EmbeddingBag with dense gradients
and a Linear head; 15 MiB of gradients against the MLP's 16) computes almost nothing per parameter, so its
step is dominated by the gradient all-reduce: the communication-bound case.
"""
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from torchdist_ext.bench._common import parser, print_command, seeded_order, spawn_ranks

__all__ = ["main"]

CONFIGS = [("ours", "tdx"), ("torch", "tdx"), ("torch", "gloo"), ("ours", "gloo")]


class _BagOfWords(torch.nn.Module):
    """A text classifier: the mean of a bag of token embeddings (dense gradients), then a Linear."""

    def __init__(self, vocab, dim, classes=10):
        super().__init__()
        self.embed = torch.nn.EmbeddingBag(vocab, dim, mode="mean")
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, tokens):
        return self.head(self.embed(tokens))


def _model(args):
    if args.model == "embedding":
        return _BagOfWords(args.vocab, args.width)
    layers = []
    for _ in range(args.depth):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 10))


def _describe(args):
    params = sum(t.numel() for t in _model(args).parameters())
    if args.model == "embedding":
        what = f"EmbeddingBag({args.vocab}, {args.width}, mean) + Linear({args.width}, 10), bags of {args.tokens} tokens"
    else:
        what = f"{args.depth}x Linear({args.width})"
    return f"model={what} ({params / 1e6:.1f} M params, {params * 4 / 2**20:.0f} MiB of gradients)"


def _time_steps(ddp, opt, x, y, steps, warmup, group):
    times = []
    for i in range(warmup + steps):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _worker(rank, args, tmpdir, results):
    import torchdist_ext

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{tmpdir}/init", rank=rank, world_size=args.world_size,
                            timeout=timedelta(seconds=300))
    groups = {b: dist.new_group(backend=b) for b in ("tdx", "gloo")}
    g = torch.Generator().manual_seed(rank)
    if args.model == "embedding":
        x = torch.randint(0, args.vocab, (args.batch, args.tokens), generator=g)
    else:
        x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    rows = []
    # Every (bucket size, configuration) pair takes one turn per round, in a new order each round
    # (shuffled with the round as the seed, so every rank agrees): neither a slow spell of the
    # machine, nor the colder first turns of a process, nor the state the turn before leaves
    # behind (a DDP on gloo before ours on tdx costs ours about 1 ms per step) falls on one pair.
    turns = [(b, c) for b in args.bucket_mb for c in CONFIGS]
    times = {t: [] for t in turns}
    for r in range(args.rounds):
        for bucket_mb, (impl, backend) in seeded_order(turns, r):
            torch.manual_seed(0)
            model = _model(args)
            cls = (torchdist_ext.DistributedDataParallel if impl == "ours"
                   else torch.nn.parallel.DistributedDataParallel)
            ddp = cls(model, process_group=groups[backend], bucket_cap_mb=bucket_mb)
            opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
            t = _time_steps(ddp, opt, x, y, args.steps, args.warmup, groups[backend])
            worst = torch.tensor([t])
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            times[(bucket_mb, (impl, backend))].append(worst.item())
            del ddp
    for (bucket_mb, (impl, backend)), ts in times.items():
        rows.append((bucket_mb, impl, backend, statistics.median(ts)))
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def main(argv=None):
    p = parser("ddp", __doc__, steps=30, warmup=5, batch=8,
               batch_help="per rank; small keeps the model communication-bound")
    p.add_argument("--model", choices=["mlp", "embedding"], default="mlp",
                   help="mlp: --depth Linear(--width) layers; embedding: a bag-of-words classifier, "
                        "EmbeddingBag(--vocab, --width) + Linear (dense gradients, little compute per parameter)")
    p.add_argument("--width", type=int, default=None,
                   help="Linear layer width (params grow as width^2; default 1024), or the embedding dimension "
                        "(default 40)")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--vocab", type=int, default=100_000, help="embedding rows (--model embedding)")
    p.add_argument("--tokens", type=int, default=32, help="tokens per bag (--model embedding)")
    p.add_argument("--rounds", type=int, default=3, help="turns each configuration takes (median over rounds)")
    p.add_argument("--bucket-mb", default="25", help="comma list of bucket_cap_mb values to sweep")
    args = p.parse_args(argv)
    args.bucket_mb = [float(v) for v in args.bucket_mb.split(",")]
    if args.width is None:
        args.width = 40 if args.model == "embedding" else 1024
    print_command("ddp", argv)
    print(f"# world_size={args.world_size} {_describe(args)} batch={args.batch}/rank torch {torch.__version__} "
          f"cores={os.cpu_count()} loadavg={os.getloadavg()[0]:.2f}")
    rows = spawn_ranks(_worker, args.world_size, args)
    by = {(b, i, k): t for b, i, k, t in rows}
    print(f"{'bucket_mb':>9} {'ours/tdx ms':>12} {'torch/tdx ms':>13} {'torch/gloo ms':>14} {'ours/gloo ms':>13}"
          f" {'ours vs torch (tdx)':>20} {'ours/tdx vs torch/gloo':>23}")
    for b in args.bucket_mb:
        t = {k: by[(b,) + k] * 1e3 for k in CONFIGS}
        print(f"{b:>9g} {t[('ours', 'tdx')]:>12.2f} {t[('torch', 'tdx')]:>13.2f} {t[('torch', 'gloo')]:>14.2f} "
              f"{t[('ours', 'gloo')]:>13.2f} {t[('torch', 'tdx')] / t[('ours', 'tdx')]:>19.2f}x "
              f"{t[('torch', 'gloo')] / t[('ours', 'tdx')]:>22.2f}x")


if __name__ == "__main__":
    main()
