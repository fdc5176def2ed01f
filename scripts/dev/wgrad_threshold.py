"""Where batched weight gradients pay: one stage of 4 x (Linear(w, w) + ReLU) in one process, 8
micro-batches, each a forward then its backward (1F1B's rhythm), with and without batching every
layer (``WeightGradBatcher``, flushed every 2 backwards as a 2-stage pipeline does), taking turns.

    python scripts/dev/wgrad_threshold.py --widths 256,384,512,1024 --rows 8,16,32,64

Prints per (width, rows per micro-batch) the CPU time of the step (``time.thread_time``, so other
processes on a loaded machine count less) without / with batching (above 1: batching pays), the
figures behind ``csrc/tuning/pipeline.h``'s threshold.
"""
import argparse
import contextlib
import os
import statistics
import time

import torch

from torchdist_ext.pipeline._wgrad import WeightGradBatcher


def _step(model, batcher, xs, gs):
    t0 = time.thread_time()
    for i, (x, g) in enumerate(zip(xs, gs)):
        with batcher.capture() if batcher is not None else contextlib.nullcontext():
            y = model(x)
        y.backward(g)
        if batcher is not None and i % 2 == 1:
            batcher.flush()
    if batcher is not None:
        batcher.flush()
    t = time.thread_time() - t0
    for p in model.parameters():
        p.grad = None
    return t


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--widths", default="256,384,512,1024")
    p.add_argument("--rows", default="8,16,32,64", help="rows per micro-batch")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=36)
    a = p.parse_args()
    torch.set_num_threads(1)
    print(f"# python scripts/dev/wgrad_threshold.py --widths {a.widths} --rows {a.rows} --microbatches "
          f"{a.microbatches} --steps {a.steps}")
    print(f"# torch {torch.__version__}, cores={os.cpu_count()}, loadavg {os.getloadavg()[0]:.2f}; CPU ms per step, "
          "median of the steps after 4 warm-up ones")
    print(f"{'width':>5} {'rows':>4} | {'batched':>8} {'per mb':>8} | per mb / batched")
    for w in (int(v) for v in a.widths.split(",")):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(w, w), torch.nn.ReLU())])
        batcher = WeightGradBatcher(model)
        for rows in (int(v) for v in a.rows.split(",")):
            xs = [torch.randn(rows, w, requires_grad=True) for _ in range(a.microbatches)]
            gs = [torch.randn(rows, w) for _ in range(a.microbatches)]
            on, off = [], []
            for i in range(a.steps + 4):
                t_on, t_off = _step(model, batcher, xs, gs), _step(model, None, xs, gs)
                if i >= 4:
                    on.append(t_on)
                    off.append(t_off)
            on_ms, off_ms = statistics.median(on) * 1e3, statistics.median(off) * 1e3
            print(f"{w:>5} {rows:>4} | {on_ms:>8.2f} {off_ms:>8.2f} | {off_ms / on_ms:.2f}x", flush=True)
    print(f"# loadavg after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
