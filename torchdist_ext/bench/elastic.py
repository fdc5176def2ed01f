"""Elastic training: what a failure costs, and what being ready for one costs without a failure.

    python -m torchdist_ext.bench elastic ddp --rounds 6        # failure notice, ElasticDDP recovery
    python -m torchdist_ext.bench elastic restart --rounds 3    # against torchrun restarting from a checkpoint
    python -m torchdist_ext.bench elastic overhead              # ElasticDDP's step without a failure
    python -m torchdist_ext.bench elastic rejoin --ranks 4      # ElasticDDP's step when it admits joiners
    python -m torchdist_ext.bench elastic fsdp --ranks 2        # ElasticFSDP: memory, step, recovery
    python -m torchdist_ext.bench elastic pipeline --ranks 4    # ElasticPipeline: memory, step, recovery

- ``ddp``: (1) the time from a victim rank's failure (``sys.exit(3)`` inside an ``except`` block,
  as torch.multiprocessing does; SIGTERM) to the moment a peer blocked in all_reduce raises, with
  the failure notice on and, as the anchor of the same run, off (``TDX_FAILURE_NOTICE=0``: peers
  learn of the failure only once the process has died), interleaved rounds of 2 ranks; (2)
  ElasticDDP on 4 ranks: the time from SIGKILL of rank 3 to the survivors' next completed step,
  beside the recovery itself and the median step (``--rounds`` // 3 runs, at least one).
- ``restart``: the wall time a SIGKILL costs ``examples/train_ddp.py`` (3 ranks, 4 epochs) under
  ``torchrun --max-restarts=1`` (restart from the per-epoch checkpoint) and with ``--elastic`` (in
  place), each against its own run without a failure. Needs a checkout (the example script).
- ``overhead``: ElasticDDP.step against the same step with DistributedDataParallel alone, 2 ranks,
  interleaved.
- ``rejoin``: ElasticDDP.step with ``rejoin=True`` (a check for joiners every step: one 8-byte
  broadcast from rank 0, started at a step and waited at the next) against ``rejoin=False``,
  ``--ranks`` ranks, interleaved; and that broadcast alone, waited at once (what the step does not
  wait for).
- ``fsdp`` / ``pipeline``: bytes of the replica each rank keeps (the neighbour's shards, or the next
  stage, with their optimizer state, and the packed gradient buffers) against the rank's own; the
  step against the plain FullyShardedDataParallel (stages 3 and 1) or PipelineStage + Schedule1F1B
  step on ``--ranks`` ranks, interleaved; and the recovery after SIGKILL of the last rank
  (``--rounds`` runs; on 4 ranks for fsdp, on ``--ranks`` ranks above 2 for pipeline; ``--rounds
  0`` skips it).

A benchmark, not a test: it prints tables with medians and asserts nothing on time. Raw outputs
and figures: docs/bench/elastic-*.txt and docs/elastic.md.
"""
import argparse
import functools
import os
import signal
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

from torchdist_ext._spawn import spawn_ranks
from torchdist_ext.bench._common import print_command

__all__ = ["main"]

PARTS = ("ddp", "restart", "overhead", "rejoin", "fsdp", "pipeline")
WIDTH = 256


# ---- ranks that may die on purpose (run by torchdist_ext._spawn.spawn_ranks) -------------------

def _values(outcome, ranks):
    """The return values of ``ranks`` that finished; raises with the tracebacks if none did."""
    values = [outcome[r][1] for r in ranks if outcome[r][0] == "ok"]
    if not values:
        raise SystemExit("bench elastic: no surviving rank finished:\n" + "\n".join(
            f"--- rank {r}: {outcome[r][0]} ---\n{outcome[r][1]}" for r in ranks))
    return values


def _all_values(outcome):
    failed = {r: o for r, o in outcome.items() if o[0] != "ok"}
    if failed:
        raise SystemExit("bench elastic: ranks failed:\n" + "\n".join(
            f"--- rank {r}: {status} ---\n{value}" for r, (status, value) in sorted(failed.items())))
    return [outcome[r][1] for r in sorted(outcome)]


# ---- shared measurement helpers ---------------------------------------------------------------

def _store():
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def interleaved(step_a, step_b, steps):
    """Median seconds of ``step_a`` and of ``step_b``, run alternately ``steps`` times each (the
    first fifth of each dropped as warm-up)."""
    a, b = [], []
    for _ in range(steps):
        t = time.perf_counter()
        step_a()
        a.append(time.perf_counter() - t)
        t = time.perf_counter()
        step_b()
        b.append(time.perf_counter() - t)
    return statistics.median(a[steps // 5:]), statistics.median(b[steps // 5:])


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
        rows += _values(spawn_ranks(body, ranks, *args), range(ranks - 1))
    print(f"{title}, {rounds} runs (seconds)")
    print(f"{'kill -> next step done p50':>28} {'p90':>8} {'recovery p50':>13} {'step p50':>9}")
    print(f"{statistics.median(r[0] for r in rows):>28.3f} {_pct([r[0] for r in rows], 0.9):>8.3f} "
          f"{statistics.median(r[2] for r in rows):>13.3f} {statistics.median(r[1] for r in rows):>9.4f}")


# ---- ddp: failure notice and ElasticDDP recovery ----------------------------------------------

def _notice_body(rank, ws, mode):
    import torch.distributed as dist

    for _ in range(20):
        dist.all_reduce(torch.ones(8))
    if rank == 1:
        time.sleep(0.2)
        _store().set("t0", repr(time.time()))
        if mode == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)
        try:
            raise ValueError("boom")
        except ValueError:
            sys.exit(3)
    try:
        dist.all_reduce(torch.ones(1 << 16))
    except dist.DistBackendError:
        t1 = time.time()
    return t1 - float(_store().get("t0"))


def _mlp(sizes):
    torch.manual_seed(0)
    layers = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _ddp_kill_body(rank, ws, kill_step, steps):
    from torchdist_ext.elastic import ElasticDDP

    model = _mlp([WIDTH, 2 * WIDTH, WIDTH])
    trainer = ElasticDDP(model, torch.optim.SGD(model.parameters(), lr=0.01))
    x, y = torch.randn(32, WIDTH), torch.randn(32, WIDTH)
    after_kill, step = steps_killing_last(
        rank, ws, lambda: trainer.step(lambda m: torch.nn.functional.mse_loss(m(x), y)), kill_step, steps)
    return after_kill, step, trainer.recoveries[0]["seconds"]


def ddp(rounds):
    cols = {}
    for _ in range(rounds):
        for mode in ("sys_exit", "sigterm"):
            for notice in ("1", "0"):
                status, dt = spawn_ranks(_notice_body, 2, mode, env={"TDX_FAILURE_NOTICE": notice}, timeout=200)[0]
                if status == "ok":
                    cols.setdefault((mode, notice), []).append(dt)
    print("failure notice: victim's failure -> peer raises (ms), 2 ranks")
    print(f"{'how':<10} {'notice':>7} {'n':>3} {'p50':>9} {'p90':>9}")
    for (mode, notice), xs in sorted(cols.items()):
        print(f"{mode:<10} {'on' if notice == '1' else 'off':>7} {len(xs):>3} {1e3 * statistics.median(xs):>9.1f} "
              f"{1e3 * _pct(xs, 0.9):>9.1f}")
    recovery_table(_ddp_kill_body, 4, (20, 30), max(1, rounds // 3), "ElasticDDP, 4 ranks, SIGKILL of rank 3 at step 20")


# ---- restart: against torchrun restarting from a checkpoint -----------------------------------

def _example_script():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = os.path.join(root, "examples", "train_ddp.py")
    if not os.path.isfile(script):
        raise SystemExit(f"bench elastic restart: needs a source checkout of torchdist_ext ({script} does not exist); "
                         "run it from a checkout installed with `pip install -e .` or with PYTHONPATH=<checkout>")
    return script


def _wall_seconds(argv):
    import subprocess

    t = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    elapsed = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"bench elastic restart: {' '.join(argv)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return elapsed


def restart(rounds, nproc=3, epochs=4, fail_step=23):
    script, common = _example_script(), ["--epochs", str(epochs)]

    def torchrun(fail):
        tmp = tempfile.mkdtemp(prefix="tdx-bench-")
        extra = ["--fail-at-step", str(fail_step), "--fail-once-file", os.path.join(tmp, "failed")] if fail else []
        return [sys.executable, "-m", "torchdist_ext.run", "--standalone", f"--nproc-per-node={nproc}",
                "--max-restarts=1", "--log-dir", os.path.join(tmp, "logs"), script, *common,
                "--checkpoint", os.path.join(tmp, "ck.pt"), *extra]

    def elastic(fail):
        return [sys.executable, script, "--elastic", "--nproc", str(nproc), *common,
                *(["--fail-at-step", str(fail_step)] if fail else [])]

    cols = {}
    for _ in range(rounds):
        for name, make in (("torchrun restart", torchrun), ("elastic in place", elastic)):
            for fail in (False, True):
                cols.setdefault((name, fail), []).append(_wall_seconds(make(fail)))
    print(f"examples/train_ddp.py, {nproc} ranks, {epochs} epochs, SIGKILL of rank 1 before step {fail_step} "
          f"(mid epoch 2); wall seconds, median of {rounds}")
    print(f"{'how':<18} {'no failure':>11} {'failure':>9} {'time lost':>10}")
    for name in ("torchrun restart", "elastic in place"):
        ok, bad = statistics.median(cols[(name, False)]), statistics.median(cols[(name, True)])
        print(f"{name:<18} {ok:>11.2f} {bad:>9.2f} {bad - ok:>10.2f}")


# ---- overhead: ElasticDDP without a failure ---------------------------------------------------

def _ddp_overhead_body(rank, ws, steps):
    import torch.nn.functional as F

    from torchdist_ext import DistributedDataParallel
    from torchdist_ext.elastic import ElasticDDP

    plain_net, elastic_net = _mlp([64, 128, 10]), _mlp([64, 128, 10])
    plain_opt = torch.optim.SGD(plain_net.parameters(), lr=0.1)
    plain = DistributedDataParallel(plain_net)
    elastic = ElasticDDP(elastic_net, torch.optim.SGD(elastic_net.parameters(), lr=0.1))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def plain_step():
        plain_opt.zero_grad(set_to_none=True)
        F.cross_entropy(plain(x), y).backward()
        plain_opt.step()

    return interleaved(plain_step, lambda: elastic.step(lambda m: F.cross_entropy(m(x), y)), steps)


def overhead(steps):
    out = _all_values(spawn_ranks(_ddp_overhead_body, 2, steps))
    print(f"no-failure step, 2 ranks, MLP 64-128-10, batch 32, median of {steps - steps // 5} interleaved steps (ms)")
    print(f"{'rank':>4} {'DDP':>8} {'ElasticDDP':>11} {'ratio':>6}")
    for r, (a, b) in enumerate(out):
        print(f"{r:>4} {1e3 * a:>8.3f} {1e3 * b:>11.3f} {b / a:>6.2f}")


# ---- rejoin: what being ready to admit a joiner costs ------------------------------------------

def _rejoin_body(rank, ws, steps):
    import torch.distributed as dist
    import torch.nn.functional as F

    from torchdist_ext.elastic import ElasticDDP
    from torchdist_ext.elastic._rejoin import tickets_seen

    plain_net, ready_net = _mlp([64, 128, 10]), _mlp([64, 128, 10])
    plain = ElasticDDP(plain_net, torch.optim.SGD(plain_net.parameters(), lr=0.1))
    ready = ElasticDDP(ready_net, torch.optim.SGD(ready_net.parameters(), lr=0.1), rejoin=True)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    a, b = interleaved(lambda: plain.step(lambda m: F.cross_entropy(m(x), y)),
                       lambda: ready.step(lambda m: F.cross_entropy(m(x), y)), steps)
    watcher, checks = ready._rejoin["watcher"], []
    for _ in range(steps):
        t = time.perf_counter()
        tickets_seen(watcher, dist.group.WORLD)
        checks.append(time.perf_counter() - t)
    return a, b, statistics.median(checks)


def rejoin(ranks, steps):
    out = _all_values(spawn_ranks(_rejoin_body, ranks, steps))
    print(f"no-failure step, {ranks} ranks, MLP 64-128-10, batch 32, median of {steps - steps // 5} interleaved steps "
          f"(ms); the check's broadcast alone, synchronous: median of {steps} (us)")
    print(f"{'rank':>4} {'rejoin=False':>13} {'rejoin=True':>12} {'ratio':>6} {'check us':>9}")
    for r, (a, b, c) in enumerate(out):
        print(f"{r:>4} {1e3 * a:>13.3f} {1e3 * b:>12.3f} {b / a:>6.2f} {1e6 * c:>9.1f}")


# ---- fsdp: ElasticFSDP ------------------------------------------------------------------------

class Block(nn.Sequential):
    """A hidden layer; each is an FSDP unit of its own (the root holds the head)."""


def _fsdp_net():
    torch.manual_seed(0)
    return nn.Sequential(*[Block(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(4)], nn.Linear(WIDTH, 10))


def _fsdp_policy():
    from torchdist_ext import ModuleWrapPolicy

    return ModuleWrapPolicy({Block})


def _adam():
    return functools.partial(torch.optim.Adam, lr=1e-3)


def _fsdp_overhead_body(rank, ws, stage, steps, batch):
    import torch.nn.functional as F

    from torchdist_ext import FullyShardedDataParallel
    from torchdist_ext.elastic import ElasticFSDP

    plain = FullyShardedDataParallel(_fsdp_net(), stage=stage, auto_wrap_policy=_fsdp_policy())
    plain_opt = _adam()(plain.parameters())
    elastic = ElasticFSDP(_fsdp_net(), _adam(), stage=stage, auto_wrap_policy=_fsdp_policy())
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, WIDTH, generator=g), torch.randint(0, 10, (batch,), generator=g)

    def plain_step():
        plain_opt.zero_grad(set_to_none=True)
        F.cross_entropy(plain(x), y).backward()
        plain_opt.step()

    a, b = interleaved(plain_step, lambda: elastic.step(lambda m: F.cross_entropy(m(x), y)), steps)
    shards = [u.shard for u in elastic.model.units]
    state = [v for p in shards for v in elastic.optimizer.state[p].values() if isinstance(v, torch.Tensor)]
    rep = elastic.replica.nbytes()
    full = sum(p.numel() for p in _fsdp_net().parameters()) * 4
    return a, b, _bytes(shards) + _bytes(state), (rep["shards"] + rep["optimizer"], rep["buffers"]), full


def _fsdp_kill_body(rank, ws, stage, kill_step, steps, batch):
    import torch.nn.functional as F

    from torchdist_ext.elastic import ElasticFSDP

    trainer = ElasticFSDP(_fsdp_net(), _adam(), stage=stage, auto_wrap_policy=_fsdp_policy())
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, WIDTH, generator=g), torch.randint(0, 10, (batch,), generator=g)
    after_kill, step = steps_killing_last(rank, ws, lambda: trainer.step(lambda m: F.cross_entropy(m(x), y)),
                                          kill_step, steps)
    return after_kill, step, trainer.recoveries[0]["seconds"]


def fsdp(ranks, steps, rounds, batch):
    for stage in (3, 1):
        out = _all_values(spawn_ranks(_fsdp_overhead_body, ranks, stage, steps, batch, timeout=900))
        print(f"stage {stage}, {ranks} ranks, MLP 4x{WIDTH}-{WIDTH} + head (units: each block), Adam, batch "
              f"{batch}; median of {steps - steps // 5} interleaved no-failure steps")
        print(f"{'rank':>4} {'FSDP ms':>8} {'Elastic ms':>11} {'ratio':>6} {'own shard+opt B':>16} "
              f"{'replica shard+opt B':>20} {'+grad bufs B':>12} {'model fp32 B':>13}")
        for r, (a, b, own, (rep, buf), full) in enumerate(out):
            print(f"{r:>4} {1e3 * a:>8.3f} {1e3 * b:>11.3f} {b / a:>6.2f} {own:>16} {rep:>20} {buf:>13} {full:>13}")
    if rounds > 0:
        recovery_table(_fsdp_kill_body, 4, (3, 20, 30, batch), rounds, "stage 3, 4 ranks, SIGKILL of rank 3 at step 20")


# ---- pipeline: ElasticPipeline ----------------------------------------------------------------

_MICROBATCHES = 4


def _pipeline_net():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(8)], nn.Linear(WIDTH, 10))


def _pipeline_data(batch):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, WIDTH, generator=g), torch.randint(0, 10, (batch,), generator=g)


def _pipeline_overhead_body(rank, ws, steps, batch):
    import torch.nn.functional as F

    from torchdist_ext.elastic import ElasticPipeline
    from torchdist_ext.pipeline import PipelineStage, Schedule1F1B, split_sequential

    part = split_sequential(_pipeline_net(), ws)[rank]
    stage = PipelineStage(part, rank, ws, "cpu")
    sched = Schedule1F1B(stage, _MICROBATCHES, loss_fn=F.cross_entropy)
    plain_opt = _adam()(part.parameters())
    elastic = ElasticPipeline(_pipeline_net(), _adam(), _MICROBATCHES, F.cross_entropy)
    x, y = _pipeline_data(batch)

    def plain_step():
        plain_opt.zero_grad(set_to_none=True)
        sched.step(*([x] if stage.is_first else []), **({"target": y} if stage.is_last else {}))
        plain_opt.step()

    a, b = interleaved(plain_step, lambda: elastic.step(x, target=y), steps)
    own = list(elastic.parts[rank].parameters())
    state = [v for p in own for v in elastic.optimizer.state[p].values() if isinstance(v, torch.Tensor)]
    rep = elastic.replica.nbytes()
    return a, b, _bytes(own) + _bytes(state), (rep["shards"] + rep["optimizer"], rep["buffers"])


def _pipeline_kill_body(rank, ws, kill_step, steps, batch):
    import torch.nn.functional as F

    from torchdist_ext.elastic import ElasticPipeline

    trainer = ElasticPipeline(_pipeline_net(), _adam(), _MICROBATCHES, F.cross_entropy)
    x, y = _pipeline_data(batch)
    after_kill, step = steps_killing_last(rank, ws, lambda: trainer.step(x, target=y), kill_step, steps)
    return after_kill, step, trainer.recoveries[0]["seconds"]


def pipeline(ranks, steps, rounds, batch):
    out = _all_values(spawn_ranks(_pipeline_overhead_body, ranks, steps, batch, timeout=900))
    print(f"{ranks} stages (one per rank), MLP 8x{WIDTH}-{WIDTH} + head, 1F1B, {_MICROBATCHES} micro-batches of "
          f"{batch // _MICROBATCHES}, Adam; median of {steps - steps // 5} interleaved no-failure steps")
    print(f"{'rank':>4} {'pipeline ms':>12} {'Elastic ms':>11} {'ratio':>6} {'own stage+opt B':>16} "
          f"{'replica+opt B':>14} {'+grad bufs B':>13}")
    for r, (a, b, own, (rep, buf)) in enumerate(out):
        print(f"{r:>4} {1e3 * a:>12.3f} {1e3 * b:>11.3f} {b / a:>6.2f} {own:>16} {rep:>14} {buf:>13}")
    if ranks > 2 and rounds > 0:
        recovery_table(_pipeline_kill_body, ranks, (20, 30, batch), rounds,
                       f"{ranks} stages, SIGKILL of rank {ranks - 1} (the last stage) at step 20")


# ---- command line -----------------------------------------------------------------------------

_DEFAULTS = {  # (ranks, steps, rounds, batch) per part; None: the part has no such option
    "ddp": (None, None, 9, None),
    "restart": (None, None, 3, None),
    "overhead": (None, 300, None, None),
    "rejoin": (2, 300, None, None),
    "fsdp": (2, 200, 3, 32),
    "pipeline": (2, 200, 3, 64),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m torchdist_ext.bench elastic", description=__doc__.split("\n")[0])
    p.add_argument("part", choices=PARTS, help="what to measure (see the module docstring)")
    p.add_argument("--ranks", type=int, help="ranks (fsdp: of the no-failure comparison; pipeline: stages); default 2")
    p.add_argument("--steps", type=int, help="interleaved steps of each kind (overhead 300, fsdp / pipeline 200)")
    p.add_argument("--rounds", type=int, help="rounds or recovery runs (ddp 9, restart 3, fsdp / pipeline 3; "
                                              "0 skips the recovery of fsdp / pipeline)")
    p.add_argument("--batch", type=int, help="samples per rank and step (fsdp 32) or per step (pipeline 64)")
    args = p.parse_args(argv)
    for name, default in zip(("ranks", "steps", "rounds", "batch"), _DEFAULTS[args.part]):
        value = getattr(args, name)
        if value is not None and default is None:
            p.error(f"--{name} does not apply to `elastic {args.part}`")
        if value is None:
            setattr(args, name, default)
        elif value < (0 if name == "rounds" else 1):
            p.error(f"--{name} must be at least {0 if name == 'rounds' else 1}, got {value}")
    if args.part in ("fsdp", "pipeline") and args.ranks < 2:
        p.error(f"`elastic {args.part}` needs --ranks >= 2, got {args.ranks}")
    return args


def main(argv=None):
    args = parse_args(argv)
    print_command("elastic", argv)
    print(f"# load: {os.getloadavg()}", flush=True)
    if args.part == "ddp":
        ddp(args.rounds)
    elif args.part == "restart":
        restart(args.rounds)
    elif args.part == "overhead":
        overhead(args.steps)
    elif args.part == "rejoin":
        rejoin(args.ranks, args.steps)
    elif args.part == "fsdp":
        fsdp(args.ranks, args.steps, args.rounds, args.batch)
    else:
        pipeline(args.ranks, args.steps, args.rounds, args.batch)
    print(f"# load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
