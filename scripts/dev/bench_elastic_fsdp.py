"""ElasticFSDP figures (a benchmark, not a test; prints tables, asserts nothing on time).

1. Memory: bytes of the neighbour replica per rank (its shards and optimizer state, and the packed
   gradient send and receive buffers) against the rank's own shards + optimizer state.
2. Time per step without a failure: ElasticFSDP.step against the same step with plain
   FullyShardedDataParallel (same model, optimizer and data), interleaved, median.
3. Recovery: the time from SIGKILL of the last rank to the survivors' next completed step, beside
   the recovery itself (gone ranks, shrink, rebuild, re-shard) and the median step.

    (python scripts/dev/bench_elastic_fsdp.py --ranks 2 --rounds 5
     python scripts/dev/bench_elastic_fsdp.py --ranks 2 --batch 512 --rounds 3
     python scripts/dev/bench_elastic_fsdp.py --ranks 4 --rounds 3) > docs/bench/elastic-fsdp-2core.txt
"""
import argparse
import functools
import os
import signal
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
from _dist import run_ranks  # noqa: E402
from bench_elastic import _pct, interleaved  # noqa: E402

WIDTH, DEPTH = 256, 4


class Block(nn.Sequential):
    """A hidden layer; each is a unit of its own (the root holds the head)."""


def _net():
    torch.manual_seed(0)
    return nn.Sequential(*[Block(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(DEPTH)], nn.Linear(WIDTH, 10))


def _policy():
    from torchdist_ext import ModuleWrapPolicy

    return ModuleWrapPolicy({Block})


def _bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _overhead_body(rank, ws, stage, steps, batch):
    import torch.nn.functional as F

    from torchdist_ext import FullyShardedDataParallel
    from torchdist_ext.elastic import ElasticFSDP

    opt_fn = functools.partial(torch.optim.Adam, lr=1e-3)
    plain = FullyShardedDataParallel(_net(), stage=stage, auto_wrap_policy=_policy())
    plain_opt = opt_fn(plain.parameters())
    elastic = ElasticFSDP(_net(), opt_fn, stage=stage, auto_wrap_policy=_policy())
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, WIDTH, generator=g), torch.randint(0, 10, (batch,), generator=g)

    def plain_step():
        plain_opt.zero_grad(set_to_none=True)
        F.cross_entropy(plain(x), y).backward()
        plain_opt.step()

    a, b = interleaved(plain_step, lambda: elastic.step(lambda m: F.cross_entropy(m(x), y)), steps)
    shards = [u.shard for u in elastic.model.units]
    state = [v for p in shards for v in elastic.optimizer.state[p].values() if isinstance(v, torch.Tensor)]
    own = _bytes(shards) + _bytes(state)
    rep = elastic.replica.nbytes()
    replica = (rep["shards"] + rep["optimizer"], rep["buffers"])
    full = sum(p.numel() for p in _net().parameters()) * 4
    return a, b, own, replica, full


def overhead(ranks, stage, steps, batch):
    out = run_ranks(_overhead_body, ranks, stage, steps, batch, timeout=900)
    print(f"stage {stage}, {ranks} ranks, MLP {DEPTH}x{WIDTH}-{WIDTH} + head (units: each block), Adam, batch "
          f"{batch}; median of {steps - steps // 5} interleaved no-failure steps")
    print(f"{'rank':>4} {'FSDP ms':>8} {'Elastic ms':>11} {'ratio':>6} {'own shard+opt B':>16} "
          f"{'replica shard+opt B':>20} {'+grad bufs B':>12} {'model fp32 B':>13}")
    for r, (a, b, own, (rep, buf), full) in enumerate(out):
        print(f"{r:>4} {1e3 * a:>8.3f} {1e3 * b:>11.3f} {b / a:>6.2f} {own:>16} {rep:>20} {buf:>13} {full:>13}")


def _store():
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def steps_killing_last(rank, ws, step, kill_step, steps):
    """Runs ``step()`` ``steps`` times; the last rank SIGKILLs itself before step ``kill_step`` (its
    time in the store). Returns (seconds from the kill to the end of that step, median step before)."""
    times = []
    for i in range(steps):
        if rank == ws - 1 and i == kill_step:
            _store().set("tkill", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        t = time.time()
        step()
        times.append(time.time() - t)
        if i == kill_step:
            after_kill = time.time() - float(_store().get("tkill"))
    return after_kill, statistics.median(times[:kill_step])


def recovery_table(body, ranks, args, rounds, title):
    """Runs ``body(rank, ws, *args) -> (kill -> next step done, step, recovery seconds)`` ``rounds``
    times on ``ranks`` ranks (the last one dies) and prints the survivors' medians."""
    rows = []
    for _ in range(rounds):
        out = run_ranks(body, ranks, *args, pg_timeout=60, expect_failure_ranks=True, timeout=600)
        rows += [out[r][1] for r in range(ranks - 1) if out[r][0] == "ok"]
    print(f"{title}, {rounds} runs (seconds)")
    print(f"{'kill -> next step done p50':>28} {'p90':>8} {'recovery p50':>13} {'step p50':>9}")
    print(f"{statistics.median(r[0] for r in rows):>28.3f} {_pct([r[0] for r in rows], 0.9):>8.3f} "
          f"{statistics.median(r[2] for r in rows):>13.3f} {statistics.median(r[1] for r in rows):>9.4f}")


def _kill_body(rank, ws, stage, kill_step, steps, batch):
    import torch.nn.functional as F

    from torchdist_ext.elastic import ElasticFSDP

    trainer = ElasticFSDP(_net(), functools.partial(torch.optim.Adam, lr=1e-3), stage=stage,
                          auto_wrap_policy=_policy())
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, WIDTH, generator=g), torch.randint(0, 10, (batch,), generator=g)
    after_kill, step = steps_killing_last(rank, ws, lambda: trainer.step(lambda m: F.cross_entropy(m(x), y)),
                                          kill_step, steps)
    return after_kill, step, trainer.recoveries[0]["seconds"]


def recovery(ranks, stage, rounds, batch):
    recovery_table(_kill_body, ranks, (stage, 20, 30, batch), rounds,
                   f"stage {stage}, {ranks} ranks, SIGKILL of rank {ranks - 1} at step 20")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2, help="ranks of the no-failure comparison (recovery uses 4)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3, help="runs of the recovery measurement")
    ap.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    args = ap.parse_args()
    print(f"# {' '.join(sys.argv)}; load: {os.getloadavg()}")
    for stage in (3, 1):
        overhead(args.ranks, stage, args.steps, args.batch)
    recovery(4, 3, args.rounds, args.batch)
    print(f"# load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
