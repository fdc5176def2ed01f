"""ElasticPipeline figures (a benchmark, not a test; prints tables, asserts nothing on time).

1. Memory: bytes of the replica per rank (the next stage's parameters and optimizer state, and the
   packed gradient send and receive buffers) against the rank's own stage + optimizer state.
2. Time per step without a failure: ElasticPipeline.step against the same step with a plain
   PipelineStage + schedule + optimizer (same model, data and schedule), interleaved, median.
3. Recovery: the time from SIGKILL of the last rank to the survivors' next completed step, beside
   the recovery itself (gone ranks, shrink, reassembly, re-split) and the median step.

    (python scripts/dev/bench_elastic_pipeline.py --ranks 2 --rounds 3
     python scripts/dev/bench_elastic_pipeline.py --ranks 4 --rounds 3) > docs/bench/elastic-pipeline-2core.txt
"""
import argparse
import functools
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
from _dist import run_ranks  # noqa: E402
from bench_elastic import interleaved  # noqa: E402
from bench_elastic_fsdp import _bytes, recovery_table, steps_killing_last  # noqa: E402

WIDTH, DEPTH, M = 256, 8, 4


def _net():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(DEPTH)],
                         nn.Linear(WIDTH, 10))


def _opt_fn():
    return functools.partial(torch.optim.Adam, lr=1e-3)


def _data(batch):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, WIDTH, generator=g), torch.randint(0, 10, (batch,), generator=g)


def _overhead_body(rank, ws, steps, batch):
    import torch.nn.functional as F

    from torchdist_ext.elastic import ElasticPipeline
    from torchdist_ext.pipeline import PipelineStage, Schedule1F1B, split_sequential

    part = split_sequential(_net(), ws)[rank]
    stage = PipelineStage(part, rank, ws, "cpu")
    sched = Schedule1F1B(stage, M, loss_fn=F.cross_entropy)
    plain_opt = _opt_fn()(part.parameters())
    elastic = ElasticPipeline(_net(), _opt_fn(), M, F.cross_entropy)
    x, y = _data(batch)

    def plain_step():
        plain_opt.zero_grad(set_to_none=True)
        sched.step(*([x] if stage.is_first else []), **({"target": y} if stage.is_last else {}))
        plain_opt.step()

    a, b = interleaved(plain_step, lambda: elastic.step(x, target=y), steps)
    own = list(elastic.parts[rank].parameters())
    state = [v for p in own for v in elastic.optimizer.state[p].values() if isinstance(v, torch.Tensor)]
    rep = elastic.replica.nbytes()
    return a, b, _bytes(own) + _bytes(state), (rep["shards"] + rep["optimizer"], rep["buffers"])


def overhead(ranks, steps, batch):
    out = run_ranks(_overhead_body, ranks, steps, batch, timeout=900)
    print(f"{ranks} stages (one per rank), MLP {DEPTH}x{WIDTH}-{WIDTH} + head, 1F1B, {M} micro-batches of {batch // M}, "
          f"Adam; median of {steps - steps // 5} interleaved no-failure steps")
    print(f"{'rank':>4} {'pipeline ms':>12} {'Elastic ms':>11} {'ratio':>6} {'own stage+opt B':>16} "
          f"{'replica+opt B':>14} {'+grad bufs B':>13}")
    for r, (a, b, own, (rep, buf)) in enumerate(out):
        print(f"{r:>4} {1e3 * a:>12.3f} {1e3 * b:>11.3f} {b / a:>6.2f} {own:>16} {rep:>14} {buf:>13}")


def _kill_body(rank, ws, kill_step, steps, batch):
    import torch.nn.functional as F

    from torchdist_ext.elastic import ElasticPipeline

    trainer = ElasticPipeline(_net(), _opt_fn(), M, F.cross_entropy)
    x, y = _data(batch)
    after_kill, step = steps_killing_last(rank, ws, lambda: trainer.step(x, target=y), kill_step, steps)
    return after_kill, step, trainer.recoveries[0]["seconds"]


def recovery(ranks, rounds, batch):
    recovery_table(_kill_body, ranks, (20, 30, batch), rounds,
                   f"{ranks} stages, SIGKILL of rank {ranks - 1} (the last stage) at step 20")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2, help="stages (ranks) of both measurements")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3, help="runs of the recovery measurement")
    ap.add_argument("--batch", type=int, default=64, help="samples per step (split into micro-batches)")
    args = ap.parse_args()
    print(f"# {' '.join(sys.argv)}; load: {os.getloadavg()}")
    overhead(args.ranks, args.steps, args.batch)
    if args.ranks > 2:
        recovery(args.ranks, args.rounds, args.batch)
    print(f"# load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
