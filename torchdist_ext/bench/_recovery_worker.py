"""One rank of ``python -m torchdist_ext.bench recovery``: the same model, data and step log under
three ways of surviving a lost host.

    python -m torchdist_ext.bench._recovery_worker --framework ours|torchft|torchrun --out DIR ...

Started by the driver (torchdist_ext/bench/recovery.py) on the test hosts, never by hand. The model
and data are examples/train_ddp.py's (DigitsNet on scikit-learn's digits, SGD), loaded from the
checkout. Every rank appends one JSON line per event to ``DIR/<host>-<pid>.jsonl``: ``start`` (the
process began), ``ready`` (its group is formed), ``step`` (an optimizer step completed: its global
index, the world size in ranks, the wall time). Batches depend only on (step, rank, world size), so
each framework sees the same data at the same width.

- ``ours``: ElasticDDP (``rejoin=True``) under ``torchdist_ext.run --keep-survivors`` with the
  rendezvous and the store in etcd (TDX_STORE); the survivors shrink in place and retry the step; a
  returning node joins the running job (``init_distributed`` rejoins) and is admitted at a step boundary.
- ``torchft``: one replica group per host (torchft's Manager, ProcessGroupGloo, its DDP and optimizer
  wrappers; the lighthouse on the first host); a returning group heals from a live peer.
- ``torchrun``: our DDP under ``torchdist_ext.run --max-restarts`` with a checkpoint every
  ``--ckpt-every`` steps; after a failure every worker restarts from the last checkpoint.

The ranks of the victim host stop after completing ``--kill-step`` (they write ``DIR/at-kill``)
and wait for the driver's SIGKILL of their host; a rank started again on that host (a returning
node) never stops there.
"""
import argparse
import importlib
import json
import os
import socket
import sys
import time
from datetime import timedelta

__all__ = []

_FIRST_START = "go"  # the driver writes it once every rank of the first start is ready


class StepLog:
    """Appends this process's events, one JSON object a line, flushed at once."""

    def __init__(self, out, framework):
        self.host = socket.gethostname()
        self.path = os.path.join(out, f"{self.host}-{os.getpid()}.jsonl")
        self.framework = framework
        self.file = open(self.path, "a", buffering=1)

    def event(self, kind, **fields):
        rec = {"t": time.time(), "event": kind, "host": self.host, "pid": os.getpid(), **fields}
        self.file.write(json.dumps(rec) + "\n")


def _example(examples):
    """examples/train_ddp.py of the checkout, as a module (DigitsNet, load_digits_split)."""
    if examples not in sys.path:
        sys.path.insert(0, examples)
    return importlib.import_module("train_ddp")


def _batch(ds, step, rank, ws, batch):
    """The batch of `rank` at global `step` of a world of `ws` ranks: a seeded draw, the same for
    every framework."""
    import torch

    g = torch.Generator().manual_seed(step * 4099 + ws * 131 + rank)
    idx = torch.randint(len(ds), (batch,), generator=g)
    return ds.tensors[0][idx], ds.tensors[1][idx]


def _gate(args, log, **fields):
    """Says the group is formed; on the first start waits for every rank of every host."""
    log.event("ready", **fields)
    while not os.path.exists(os.path.join(args.out, _FIRST_START)):
        time.sleep(0.01)


def _at_kill(args, log, step):
    """On the victim host, after step --kill-step: says so and waits for the host's SIGKILL."""
    if step != args.kill_step or log.host != args.victim or os.environ.get("TDX_BENCH_RETURNING"):
        return
    open(os.path.join(args.out, "at-kill"), "a").close()
    time.sleep(3600)
    raise SystemExit("bench recovery: the victim host was not killed")


def _ours(args, log, ex, ds):
    """ElasticDDP with ``rejoin=True``. A returning node's ``init_distributed`` joins the running job
    (``torchdist_ext.elastic.rejoin`` through the job's store in etcd) and its trainer receives the
    parameters, optimizer state and step count from a live member; the members admit it at a step
    boundary. The global step is the trainer's ``steps_done`` (the same on members and joiners)."""
    import torch
    import torch.nn.functional as F

    import torchdist_ext
    from torchdist_ext.elastic import ElasticDDP, joined

    torchdist_ext.init_distributed("tdx", timeout=timedelta(seconds=args.pg_timeout))
    record = joined()  # None on a first start; the admission record on a returning node
    if record is not None:
        log.event("joined", rank=record["rank"], ws=record["world_size"], generation=record["generation"],
                  **{f"{k}_t": v for k, v in record["times"].items()})
    torch.manual_seed(args.seed)
    model = ex.DigitsNet()
    trainer = ElasticDDP(model, torch.optim.SGD(model.parameters(), lr=args.lr), rejoin=True)
    _gate(args, log, rank=trainer.rank, ws=trainer.world_size, resumed_at=trainer.steps_done)
    while trainer.steps_done < args.steps:
        x, y = _batch(ds, trainer.steps_done, trainer.rank, trainer.world_size, args.batch)
        seen = len(trainer.recoveries), len(trainer.rejoins)
        trainer.step(lambda m: F.cross_entropy(m(x), y))
        # what ElasticDDP says of its recoveries and admissions, as it says it
        for kind, recs in (("recovery", trainer.recoveries[seen[0]:]), ("admission", trainer.rejoins[seen[1]:])):
            for rec in recs:
                log.event(kind, **{k: v for k, v in rec.items() if isinstance(v, (int, float, str, list))})
        log.event("step", step=trainer.steps_done, ws=trainer.world_size, rank=trainer.rank)
        _at_kill(args, log, trainer.steps_done)
        time.sleep(args.step_sleep)


def _torchrun(args, log, ex, ds):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import torchdist_ext

    torchdist_ext.init_distributed("tdx", timeout=timedelta(seconds=args.pg_timeout))
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    net = ex.DigitsNet()
    opt = torch.optim.SGD(net.parameters(), lr=args.lr)
    step = 0
    if os.path.exists(args.ckpt):
        state = torch.load(args.ckpt, weights_only=False)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
    model = torchdist_ext.DistributedDataParallel(net)
    _gate(args, log, rank=rank, ws=ws, resumed_at=step)
    while step < args.steps:
        x, y = _batch(ds, step, rank, ws, args.batch)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        step += 1
        if rank == 0 and step % args.ckpt_every == 0:
            tmp = f"{args.ckpt}.tmp"
            torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, args.ckpt)
        log.event("step", step=step, ws=ws, rank=rank)
        _at_kill(args, log, step)
        time.sleep(args.step_sleep)
    dist.destroy_process_group()


def _torchft(args, log, ex, ds):
    import torch
    import torch.nn.functional as F
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
    from torchft import Optimizer as OptimizerWrapper

    group_rank, group_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store_port = int(os.environ["MASTER_PORT"])
    store = TCPStore(log.host, store_port, group_size, is_master=group_rank == 0, wait_for_workers=False)
    torch.manual_seed(args.seed)
    net = ex.DigitsNet()
    opt = torch.optim.SGD(net.parameters(), lr=args.lr)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout)),
        load_state_dict=lambda s: (net.load_state_dict(s["model"]), opt.load_state_dict(s["optimizer"])),
        state_dict=lambda: {"model": net.state_dict(), "optimizer": opt.state_dict()},
        min_replica_size=1, replica_id=log.host, store_addr=log.host, store_port=store_port,
        rank=group_rank, world_size=group_size, lighthouse_addr=args.lighthouse,
        port=store_port + 1, hostname=log.host, timeout=timedelta(seconds=args.pg_timeout))
    model = DistributedDataParallel(manager, net)
    optimizer = OptimizerWrapper(manager, opt)
    _gate(args, log, rank=group_rank, ws=group_size)
    last = manager.current_step()
    while manager.current_step() < args.steps:
        optimizer.zero_grad()  # starts the quorum: the step, the participants and this rank's place
        ws = max(manager.num_participants(), 1) * group_size  # waits for the quorum (and a heal)
        rank = (manager.participating_rank() or 0) * group_size + group_rank
        step = manager.current_step()
        x, y = _batch(ds, step, rank, ws, args.batch)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()  # commits only when every participant's all_reduce succeeded
        if manager.current_step() > last:
            last = manager.current_step()
            log.event("step", step=last, ws=ws, rank=rank)
            _at_kill(args, log, last)
        time.sleep(args.step_sleep)
    manager.shutdown(wait=False)
    del store


FRAMEWORKS = {"ours": _ours, "torchft": _torchft, "torchrun": _torchrun}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m torchdist_ext.bench._recovery_worker")
    p.add_argument("--framework", choices=sorted(FRAMEWORKS), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--examples", required=True, help="the checkout's examples/ folder")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--kill-step", type=int, required=True)
    p.add_argument("--victim", required=True, help="host name of the host to be killed")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pg-timeout", type=float, default=120.0)
    p.add_argument("--ckpt", default="")
    p.add_argument("--ckpt-every", type=int, default=1)
    p.add_argument("--lighthouse", default="")
    args = p.parse_args(argv)
    log = StepLog(args.out, args.framework)
    log.event("start", returning=bool(os.environ.get("TDX_BENCH_RETURNING")))
    import torch

    torch.set_num_threads(1)
    ex = _example(args.examples)
    train, _ = ex.load_digits_split(args.seed)
    FRAMEWORKS[args.framework](args, log, ex, train)
    log.event("done")


if __name__ == "__main__":
    main()
