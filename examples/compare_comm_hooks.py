"""Trains the same classifier on scikit-learn's digits once per DDP communication hook and
compares test accuracy and bytes sent per step.

    torchrun --standalone --nproc-per-node=2 examples/compare_comm_hooks.py [--epochs 8]

Hooks: none (fp32 all_reduce) and the C++ built-ins of torchdist_ext.comm_hooks (fp16, bf16,
int8 blockwise with error feedback, top-k 1% with error feedback). `--hooks ...,powerSGD` adds
torch's PowerSGD hook run by our reducer (with one bucket: its future callbacks issue further
collectives, and with several buckets those race with the next bucket's on any backend). Every run starts from the same initial weights and sees the same batches. The data
ships inside scikit-learn (nothing downloaded). Rank 0 prints one line per hook:
accuracy and the bytes each rank sends per step (formulas in torchdist_ext.comm_hooks).
"""
import argparse
import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import torchdist_ext
from torchdist_ext import comm_hooks
from digits_data import load_digits_tensors


def load_digits_split(seed=0, test_fraction=0.2):
    """Standardized flattened digits as (train, test) TensorDatasets, the same split on every rank."""
    (x_train, y_train), (x_test, y_test) = load_digits_tensors(seed, test_fraction, flat=True)
    return TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)


def make_model():
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def hook_for(name, topk_ratio):
    """(state, hook) for register_comm_hook, or None for the plain fp32 all_reduce."""
    if name == "none":
        return None
    if name == "powerSGD":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        return psgd.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=10,
                                  random_seed=0), psgd.powerSGD_hook
    return {"fp16": (None, comm_hooks.fp16_compress), "bf16": (None, comm_hooks.bf16_compress),
            "int8": (comm_hooks.Int8State(block=256), comm_hooks.int8_quantize),
            "topk": (comm_hooks.TopKState(ratio=topk_ratio), comm_hooks.topk_sparsify)}[name]


def bytes_per_step(name, bucket_numels, topk_ratio, ws):
    """Bytes each rank sends per step for fp32 buckets of these sizes (the documented formulas)."""
    total = 0
    for n in bucket_numels:
        if name == "none":
            total += 4 * n
        elif name in ("fp16", "bf16"):
            total += 2 * n
        elif name == "int8":
            total += n + 4 * math.ceil(n / 256)
        elif name == "topk":
            total += 12 * max(1, math.ceil(topk_ratio * n))
        else:
            return None  # PowerSGD: depends on the matrix shapes and rank; see torch's docs
    return total


def evaluate(model, loader):
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            correct += (model(x).argmax(1) == y).sum().item()
            total += len(y)
    t = torch.tensor([correct, total], dtype=torch.float64)
    dist.all_reduce(t)
    model.train()
    return 100.0 * t[0].item() / t[1].item()


def train_once(name, args, train_set, test_set):
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = make_model()
    # PowerSGD's callbacks issue collectives of their own: one bucket keeps their order fixed.
    bucket_mb = 1024.0 if name == "powerSGD" else args.bucket_mb
    ddp = torchdist_ext.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    hook = hook_for(name, args.topk_ratio)
    if hook is not None:
        ddp.register_comm_hook(*hook)
    sampler = DistributedSampler(train_set, num_replicas=ws, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    test_loader = DataLoader(test_set, batch_size=256,
                             sampler=DistributedSampler(test_set, num_replicas=ws, rank=rank, shuffle=False))
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
    elapsed = time.perf_counter() - start
    numels = [sum(list(model.parameters())[i].numel() for i in b) for b in ddp.bucket_indices()]
    return evaluate(model, test_loader), bytes_per_step(name, numels, args.topk_ratio, ws), elapsed


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--bucket-mb", type=float, default=0.25)
    p.add_argument("--topk-ratio", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="tdx")
    p.add_argument("--hooks", default="none,fp16,bf16,int8,topk")
    args = p.parse_args()
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    train_set, test_set = load_digits_split(args.seed)
    results = {}
    for name in args.hooks.split(","):
        acc, sent, secs = train_once(name, args, train_set, test_set)
        results[name] = acc
        if rank == 0:
            sent_s = f"{sent:>9,d} B/step" if sent is not None else "  (see torch docs)"
            print(f"hook {name:9s} test accuracy {acc:6.2f}%  sent per rank {sent_s}  "
                  f"({secs:.1f} s, {args.epochs} epochs)", flush=True)
    if rank == 0 and "none" in results:
        worst = min(results, key=results.get)
        print(f"no-hook accuracy {results['none']:.2f}%; largest drop: {worst} "
              f"{results['none'] - results[worst]:+.2f} points", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
