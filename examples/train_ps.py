"""Trains a digits classifier with parameter servers on backend "tdx" (torchdist_ext.ps).

    torchrun --standalone --nproc-per-node=3 examples/train_ps.py                    # 1 server, 2 workers, sync
    torchrun --standalone --nproc-per-node=4 examples/train_ps.py --servers 2 --mode ssp --staleness 2
    torchrun --standalone --nproc-per-node=3 examples/train_ps.py --mode async
    torchrun --standalone --nproc-per-node=3 examples/train_ps.py --epochs 4 --checkpoint ps.pt  # then again
                                                                  # with --epochs 8: resumes at epoch 5

The first --servers ranks are servers: each holds a shard of the parameters (balanced by bytes)
and of the SGD state, and applies the workers' pushes (sync: the mean of every worker's gradient
per step; async: each push on arrival; ssp: on arrival, a worker at clock c waiting until the
slowest is at c - s). The other ranks are workers: the usual training loop on their part of
scikit-learn's digits (bundled, nothing is downloaded), with ps.Worker around the model and
ps.PushOptimizer as the optimizer. The first worker prints one line per epoch with the loss,
its samples/s and the test accuracy of the parameters it pulled; each server prints its summary
(updates, the staleness histogram, workers finished or lost) at the end. With the defaults it
reaches about 97% test accuracy.

The learning rate follows a torch scheduler on the workers (StepLR: x0.7 per epoch), which the
servers apply with each push. With --checkpoint, the first worker writes the servers' state
(``Worker.server_state_dict()``: parameters and SGD momentum by parameter name) with its own
(optimizer, scheduler, epoch) after every epoch; a later run with the same path resumes from it,
with any number of servers and workers.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from digits_data import load_digits_tensors
from ps_common import add_ps_arguments, print_summary, start
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
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)  # drives the servers' lr
    g = torch.Generator().manual_seed(args.seed + rank)
    first_epoch = 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint, weights_only=True)
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        first_epoch = saved["epoch"]
        g = torch.Generator().manual_seed(args.seed + rank + 1000 * first_epoch)
        if i == 0:
            print(f"resumed from {args.checkpoint} after epoch {first_epoch}", flush=True)
    if i == 0:
        print(f"training on {len(workers)} workers, {cfg.num_servers} server(s), mode {cfg.mode}"
              + (f" (s={cfg.staleness})" if cfg.mode == "ssp" else "") + f", backend {dist.get_backend()}",
              flush=True)
    for epoch in range(first_epoch, args.epochs):
        t0, loss_sum = time.perf_counter(), 0.0
        perm = torch.randperm(len(x), generator=g)
        for b in range(0, len(x), args.batch_size):
            idx = perm[b:b + args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            loss_sum += loss.item() * len(idx)
        sched.step()
        elapsed = time.perf_counter() - t0
        with torch.no_grad():
            acc = (model(x_test).argmax(1) == y_test).float().mean().item()
        if i == 0:
            print(f"epoch {epoch + 1:3d}/{args.epochs}  loss {loss_sum / len(x):.4f}  {len(x) / elapsed:8.0f} "
                  f"samples/s  test accuracy {acc * 100:.2f}%  (clock {model.clock})", flush=True)
            if args.checkpoint:  # the servers' state and this worker's, at the end of the epoch
                torch.save({"servers": model.server_state_dict(), "optimizer": opt.state_dict(),
                            "scheduler": sched.state_dict(), "epoch": epoch + 1}, args.checkpoint + ".tmp")
                os.replace(args.checkpoint + ".tmp", args.checkpoint)
    model.close()
    if i == 0:
        print(f"final test accuracy {acc * 100:.2f}%", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_ps_arguments(p)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--checkpoint", default=None, help="resume from this file if it exists; write it every epoch")
    args = p.parse_args()

    rank, world, cfg = start(args)
    torch.set_num_threads(1)
    if ps.is_server(cfg):
        server = ps.ParameterServer(digits_mlp(args.seed), torch.optim.SGD, cfg, lr=args.lr, momentum=0.9)
        if args.checkpoint and os.path.exists(args.checkpoint):
            server.load_state_dict(torch.load(args.checkpoint, weights_only=True)["servers"])
        print_summary(rank, server.run())
    else:
        run_worker(args, cfg, rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
