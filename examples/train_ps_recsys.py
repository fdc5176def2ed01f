"""A recommendation-style model on parameter servers: a large embedding table, few rows per step.

    torchrun --standalone --nproc-per-node=4 examples/train_ps_recsys.py --servers 2           # sparse
    torchrun --standalone --nproc-per-node=4 examples/train_ps_recsys.py --servers 2 --dense   # every row

One table holds a vector per user and per item (200,000 rows x 16 by default, 12.8 MB), built as
``nn.Embedding(sparse=True)``: ps.Worker then keeps no copy of it, each lookup pulls the distinct
rows of the batch from the servers that hold them, and each step pushes the gradient of those rows
alone; the servers apply it as torch applies a sparse gradient (Adagrad here). ``--dense`` builds
the same model with ``sparse=False``: every step pushes and pulls the whole table. The table is
split by rows across the servers (``PSConfig(split_bytes=...)``), so they share its memory and
traffic.

The data are synthetic clicks: each user and item has a hidden vector, and a user clicks an item
when the two agree (positive dot product); each step draws a batch of pairs, popular users and
items far more often than the rest. The first
worker prints the loss and the accuracy on held-out pairs, its samples/s, and the bytes it sent and
received per step (counted at every message: ``Worker.traffic``).
"""
import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ps_common import add_ps_arguments, print_summary, start
from torchdist_ext import ps


class TwoTower(nn.Module):
    """A click model: the product of a user's row and an item's row, weighed by a linear head."""

    def __init__(self, rows, dim, sparse, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.table = nn.Embedding(rows, dim, sparse=sparse)
        nn.init.normal_(self.table.weight, std=0.1)
        self.head = nn.Linear(dim, 1)

    def forward(self, pairs):
        e = self.table(pairs)  # [batch, 2, dim]: the user's and the item's rows
        return self.head(e[:, 0] * e[:, 1]).squeeze(1)


class Clicks:
    """Synthetic clicks: user u clicks item i when their hidden 2-d vectors have a positive dot product.
    Users and items are drawn by popularity (row r of R with density falling as a power law), so a
    few rows are touched at most steps and most rarely, as in recommendation logs."""

    def __init__(self, users, items, seed, skew=10.0):
        g = torch.Generator().manual_seed(seed)
        self.users, self.items, self.skew = users, items, skew
        self.u = torch.randn(users, 2, generator=g)
        self.v = torch.randn(items, 2, generator=g)

    def batch(self, n, g):
        """(pairs of table rows [n, 2], clicks [n]): users are rows 0..U-1, items rows U..U+I-1."""
        u = (self.users * torch.rand(n, generator=g) ** self.skew).long()
        i = (self.items * torch.rand(n, generator=g) ** self.skew).long()
        clicks = ((self.u[u] * self.v[i]).sum(1) > 0).float()
        return torch.stack([u, i + self.users], 1), clicks


def run_worker(args, cfg, rank, world):
    workers = cfg.worker_ranks(world)
    first = rank == workers[0]
    data = Clicks(args.users, args.items, args.seed)
    model = ps.Worker(TwoTower(args.users + args.items, args.dim, not args.dense, args.seed), cfg)
    opt = ps.PushOptimizer(model)
    g = torch.Generator().manual_seed(args.seed + 1 + rank)
    test = data.batch(2048, torch.Generator().manual_seed(args.seed + 10_000))
    if first:
        print(f"training on {len(workers)} workers, {cfg.num_servers} server(s), mode {cfg.mode}, table "
              f"{args.users + args.items} x {args.dim} ({'dense' if args.dense else 'sparse'}), "
              f"backend {dist.get_backend()}", flush=True)
    t0, sent0, received0 = time.perf_counter(), model.traffic["sent"], model.traffic["received"]
    for step in range(1, args.steps + 1):
        pairs, clicks = data.batch(args.batch_size, g)
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(pairs), clicks)
        loss.backward()
        opt.step()
        if first and (step % args.log_every == 0 or step == args.steps):
            elapsed = time.perf_counter() - t0
            with torch.no_grad():
                acc = ((model(test[0]) > 0).float() == test[1]).float().mean().item()
            print(f"step {step:5d}  loss {loss.item():.4f}  held-out accuracy {acc * 100:.1f}%  "
                  f"{step * args.batch_size / elapsed:7.0f} samples/s", flush=True)
    if first:
        steps = args.steps
        sent = (model.traffic["sent"] - sent0) / steps
        received = (model.traffic["received"] - received0) / steps
        print(f"bytes per step on this worker: sent {sent:.0f}, received {received:.0f} "
              f"({'dense' if args.dense else 'sparse'}; the table is {4 * (args.users + args.items) * args.dim} bytes)",
              flush=True)
        print(f"final held-out accuracy {acc * 100:.1f}%", flush=True)
    model.close()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_ps_arguments(p)
    p.add_argument("--users", type=int, default=100_000)
    p.add_argument("--items", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=256, help="pairs per worker and step")
    p.add_argument("--lr", type=float, default=0.5, help="Adagrad learning rate on the servers")
    p.add_argument("--dense", action="store_true", help="nn.Embedding(sparse=False): every row travels")
    p.add_argument("--log-every", type=int, default=50)
    args = p.parse_args()

    rank, world, cfg = start(args, split_bytes=1 << 20)  # the table (12.8 MB) is split by rows
    torch.set_num_threads(1)
    if ps.is_server(cfg):
        model = TwoTower(args.users + args.items, args.dim, not args.dense, args.seed)
        print_summary(rank, ps.serve(model, torch.optim.Adagrad, cfg, lr=args.lr))
    else:
        run_worker(args, cfg, rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
