"""Trains a CNN on scikit-learn's handwritten digits with pipeline parallelism on backend "tdx".

    torchrun --standalone --nproc-per-node=2 examples/train_pipeline.py              # pp=2
    torchrun --standalone --nproc-per-node=4 examples/train_pipeline.py --dp 2       # pp=2 x dp=2
    torchrun --standalone --nproc-per-node=2 examples/train_pipeline.py --schedule zbv   # zero bubble, V

The data (1,797 8x8 images, 10 classes) ships inside scikit-learn, so nothing is downloaded. The
model is an nn.Sequential split into world_size / dp stages of balanced parameter count
(``split_sequential``; ``--split time`` balances measured time instead). Every step splits the
batch into ``--microbatches`` micro-batches and runs them through the stages with the chosen
schedule (1F1B by default; the zero-bubble ``zbh1``, ``zbv`` and ``dualpipev`` split each backward
into input and weight gradients, the last two with two stages per rank in a V) over asynchronous
send/recv. With ``--dp`` > 1 each stage is replicated
and wrapped in torchdist_ext.DistributedDataParallel over its replicas. The last stage of the first
replica prints one line per epoch with the loss, throughput and test accuracy; with the defaults
it reaches about 97-98% test accuracy.
"""
import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import torchdist_ext
from torchdist_ext.pipeline import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                    ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble,
                                    split_sequential)
from digits_data import load_digits_tensors

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
             "zbh1": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
MULTI = ("interleaved", "zbh1", "zbv", "dualpipev")  # take a list of stages
V_SHAPED = ("zbv", "dualpipev")  # rank r holds stages r and 2 x pp - 1 - r


def digits_cnn():
    """A small CNN as an nn.Sequential, so that it can be cut into stages anywhere."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(64 * 4 * 4, 128), nn.ReLU(),
        nn.Linear(128, 10),
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64, help="per replica and step; a multiple of --microbatches")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    p.add_argument("--stages-per-rank", type=int, default=2, help="only for --schedule interleaved")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the pipeline")
    p.add_argument("--split", choices=["params", "time"], default="params")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--backend", default="tdx")
    args = p.parse_args()
    if args.batch_size % args.microbatches:
        p.error(f"--batch-size {args.batch_size} must be a multiple of --microbatches {args.microbatches}")

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.dp:
        raise SystemExit(f"world size {world} is not a multiple of --dp {args.dp}")
    if args.dp > 1 and args.schedule in ("zbh1", "zbv", "dualpipev"):
        raise SystemExit(f"--schedule {args.schedule} computes weight gradients apart from autograd, which "
                         "DistributedDataParallel reduces as they arrive; use --dp 1, or 1f1b/gpipe/interleaved")
    torch.set_num_threads(1)
    pp = world // args.dp
    replica, pp_rank = divmod(rank, pp)
    # every rank creates every group, in the same order (a c10d rule)
    pp_groups = [dist.new_group(list(range(r * pp, (r + 1) * pp))) for r in range(args.dp)]
    dp_groups = [dist.new_group(list(range(s, world, pp))) for s in range(pp)]

    v = args.stages_per_rank if args.schedule == "interleaved" else 2 if args.schedule in V_SHAPED else 1
    n_stages = pp * v
    torch.manual_seed(0)
    model = digits_cnn()  # same initial weights on every rank
    (x_train, y_train), (x_test, y_test) = load_digits_tensors()
    parts = split_sequential(model, n_stages, by=args.split, example_input=x_train[:args.batch_size],
                             group=pp_groups[replica])
    mine = [pp_rank, n_stages - 1 - pp_rank] if args.schedule in V_SHAPED else [pp_rank + c * pp for c in range(v)]
    stages = []
    for i in mine:
        module = parts[i]
        if args.dp > 1:
            module = torchdist_ext.DistributedDataParallel(module, process_group=dp_groups[pp_rank])
        stages.append(PipelineStage(module, i, n_stages, "cpu", group=pp_groups[replica]))
    loss_fn = nn.functional.cross_entropy
    if args.schedule in MULTI:
        schedule = SCHEDULES[args.schedule](stages, args.microbatches, loss_fn=loss_fn)
    else:
        schedule = SCHEDULES[args.schedule](stages[0], args.microbatches, loss_fn=loss_fn)
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    reporter = last and replica == 0
    params = [q for i in mine for q in parts[i].parameters()]
    opt = torch.optim.SGD(params, lr=args.lr, momentum=0.9)
    if reporter:
        sizes = [sum(q.numel() for q in part.parameters()) for part in parts]
        print(f"pipeline: {n_stages} stages x {args.dp} replicas on {world} ranks ({args.backend}), schedule "
              f"{args.schedule}, {args.microbatches} micro-batches of {args.batch_size // args.microbatches}; "
              f"parameters per stage {sizes}", flush=True)

    def evaluate():
        """Test accuracy through the pipeline (forward only); the last partial batch is padded."""
        correct = 0
        for start in range(0, len(x_test), args.batch_size):
            xb, yb = x_test[start:start + args.batch_size], y_test[start:start + args.batch_size]
            n = len(xb)
            pad = (-n) % args.microbatches
            if pad:
                xb = torch.cat([xb, xb[:1].expand(pad, *xb.shape[1:])])
            out = schedule.eval(xb) if first else schedule.eval()
            if last:
                correct += (out[:n].argmax(1) == yb).sum().item()
        return correct / len(x_test)

    per_replica = len(x_train) // args.dp
    for epoch in range(1, args.epochs + 1):
        perm = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        mine_idx = perm[replica * per_replica:(replica + 1) * per_replica]
        t0, loss_sum, steps = time.perf_counter(), 0.0, 0
        for start in range(0, len(mine_idx) - args.batch_size + 1, args.batch_size):  # drop the partial batch
            idx = mine_idx[start:start + args.batch_size]
            opt.zero_grad()
            losses = []
            if first and last:
                schedule.step(x_train[idx], target=y_train[idx], losses=losses)
            elif first:
                schedule.step(x_train[idx])
            elif last:
                schedule.step(target=y_train[idx], losses=losses)
            else:
                schedule.step()
            opt.step()
            if losses:
                loss_sum += torch.stack(losses).mean().item()
            steps += 1
        elapsed = time.perf_counter() - t0
        acc = evaluate()
        if reporter:
            print(f"epoch {epoch:3d}/{args.epochs} loss {loss_sum / max(steps, 1):.4f} "
                  f"{steps * args.batch_size * args.dp / elapsed:8.0f} samples/s test accuracy {100 * acc:.2f}%",
                  flush=True)
    if reporter:
        print(f"final test accuracy {100 * acc:.2f}%", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
