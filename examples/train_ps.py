"""Trains a digits classifier with parameter servers on backend "tdx" (torchdist_ext.ps).

    torchrun --standalone --nproc-per-node=3 examples/train_ps.py                    # 1 server, 2 workers, sync
    torchrun --standalone --nproc-per-node=4 examples/train_ps.py --servers 2 --mode ssp --staleness 2
    torchrun --standalone --nproc-per-node=3 examples/train_ps.py --mode async

The first --servers ranks are servers: each holds a shard of the parameters (balanced by bytes)
and of the SGD state, and applies the workers' pushes (sync: the mean of every worker's gradient
per step; async: each push on arrival; ssp: on arrival, a worker at clock c waiting until the
slowest is at c - s). The other ranks are workers: the usual training loop on their part of
scikit-learn's digits (bundled, nothing is downloaded), with ps.Worker around the model and
ps.PushOptimizer as the optimizer. The first worker prints one line per epoch with the loss,
its samples/s and the test accuracy of the parameters it pulled; each server prints its summary
(updates, the staleness histogram, workers finished or lost) at the end. With the defaults it
reaches about 97% test accuracy.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torchdist_ext
from digits_data import load_digits_tensors
from torchdist_ext import ps


def digits_mlp(seed):
    """A two-layer perceptron on the 64 standardized pixels (no BatchNorm: the servers hold every
    parameter; buffers would stay on each worker)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def run_worker(args, cfg, rank, world):
    (x, y), (x_test, y_test) = load_digits_tensors(args.seed, flat=True)
    workers = cfg.worker_ranks(world)
    i = workers.index(rank)
    x, y = x[i::len(workers)], y[i::len(workers)]  # this worker's part of the training set
    model = ps.Worker(digits_mlp(args.seed), cfg)
    opt = ps.PushOptimizer(model)
    g = torch.Generator().manual_seed(args.seed + rank)
    if i == 0:
        print(f"training on {len(workers)} workers, {cfg.num_servers} server(s), mode {cfg.mode}"
              + (f" (s={cfg.staleness})" if cfg.mode == "ssp" else "") + f", backend {dist.get_backend()}",
              flush=True)
    for epoch in range(args.epochs):
        t0, loss_sum = time.perf_counter(), 0.0
        perm = torch.randperm(len(x), generator=g)
        for b in range(0, len(x), args.batch_size):
            idx = perm[b:b + args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            loss_sum += loss.item() * len(idx)
        elapsed = time.perf_counter() - t0
        with torch.no_grad():
            acc = (model(x_test).argmax(1) == y_test).float().mean().item()
        if i == 0:
            print(f"epoch {epoch + 1:3d}/{args.epochs}  loss {loss_sum / len(x):.4f}  {len(x) / elapsed:8.0f} "
                  f"samples/s  test accuracy {acc * 100:.2f}%  (clock {model.clock})", flush=True)
    model.close()
    if i == 0:
        print(f"final test accuracy {acc * 100:.2f}%", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", type=int, default=1, help="the first SERVERS ranks serve")
    p.add_argument("--mode", choices=ps.MODES, default="sync")
    p.add_argument("--staleness", type=int, default=0, help="SSP bound s (--mode ssp)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--backend", default=None, help="process-group backend (default: $TDX_BACKEND, else tdx)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    torchdist_ext.init_distributed(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    cfg = ps.PSConfig(num_servers=args.servers, mode=args.mode, staleness=args.staleness)
    if ps.is_server(cfg):
        stats = ps.serve(digits_mlp(args.seed), torch.optim.SGD, cfg, lr=args.lr, momentum=0.9)
        print(f"server rank {rank}: {stats.updates} updates from {stats.pushes} pushes in {stats.seconds:.1f} s, "
              f"staleness histogram {stats.staleness}, workers finished {sorted(stats.finished)}, "
              f"lost {sorted(stats.lost)}", flush=True)
    else:
        run_worker(args, cfg, rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
