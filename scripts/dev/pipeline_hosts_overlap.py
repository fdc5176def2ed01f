"""A pipeline across 2 test hosts (1 rank each, shaped link): step time with each receive posted one
compute action ahead (what a tdx group spanning hosts does) against right before its consumer.

    python scripts/dev/pipeline_hosts_overlap.py --link 1gbit --schedule 1f1b --steps 6

Stages: Linear(256) plus a sleep of --stage-ms in forward and backward (a computation that needs no
core, so a busy machine does not stretch it); --rows rows per micro-batch (1024: 1 MiB activations),
8 micro-batches. The two lowerings take turns step by step; prints the median step time of each
(steps after the first) and late / early.
"""
import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]


def _stage_module(stage_ms):
    from torch import nn

    from torchdist_ext.bench.pipeline_zb import _SleepIn  # sleeps in forward and in the input gradient

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(256, 256)

        def forward(self, x):
            return _SleepIn.apply(self.lin(x), stage_ms, x.shape[0])

    return Stage()


def job(rank, ws, schedule, steps, stage_ms, rows):
    """One rank: both lowerings of the same schedule, alternating; {lowering: median step ms}."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from torchdist_ext.pipeline import PipelineStage, Schedule1F1B, ScheduleGPipe

    cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    scheds = {}
    for name in ("early", "late"):
        s = cls(PipelineStage(_stage_module(float(stage_ms)), rank, ws, "cpu"), 8, loss_fn=nn.functional.mse_loss)
        s._prefetch = name == "early"  # the lowering under comparison (posts_receives_early decides it)
        scheds[name] = s
    x, y = torch.randn(8 * int(rows), 256), torch.randn(8 * int(rows), 256)
    times = {"early": [], "late": []}
    for step in range(int(steps)):
        for name in ("early", "late") if step % 2 else ("late", "early"):
            dist.barrier()
            t0 = time.perf_counter()
            scheds[name].step(x) if rank == 0 else scheds[name].step(target=y)
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--link", default="1gbit")
    p.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--stage-ms", type=float, default=20.0)
    p.add_argument("--rows", type=int, default=1024)
    args = p.parse_args()
    from _testhosts import TestHosts
    from test_hosts import collect, start_job

    with tempfile.TemporaryDirectory() as tmp, TestHosts(2, rate=None if args.link == "none" else args.link) as hosts:
        tmp = pathlib.Path(tmp)
        env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(pathlib.Path(__file__).parent)])}
        out, procs = start_job(hosts, tmp, "pipeline_hosts_overlap:job", args.schedule, args.steps, args.stage_ms,
                               args.rows, nproc_per_node=1, env=env)
        res = collect(hosts, tmp, out, procs, world_size=2, timeout=900)[0]["result"]
    print(f"# {args.schedule}, 2 hosts x 1 rank, link {args.link}, 8 micro-batches of {args.rows} x 256 fp32, "
          f"stages {args.stage_ms} ms forward and backward; load {os.getloadavg()[0]:.1f}")
    print(f"receives posted early {res['early']:.1f} ms, right before the consumer {res['late']:.1f} ms per step: "
          f"late / early {res['late'] / res['early']:.2f}x")


if __name__ == "__main__":
    main()
