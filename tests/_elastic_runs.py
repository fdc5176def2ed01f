"""What the elastic trainer tests share: the data set, the batches a DistributedSampler gives a rank,
and the single-process reference run of 4 ranks of which one dies at a given step."""
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, TensorDataset

N, BATCH, EPOCHS = 96, 4, 2
KILL_EPOCH, KILL_STEP = 0, 3


def dataset():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 6, generator=g), torch.randn(N, 2, generator=g))


def batches(ds, sampler, epoch):
    sampler.set_epoch(epoch)
    idx = list(sampler)
    for s in range(0, len(idx) - BATCH + 1, BATCH):
        b = idx[s:s + BATCH]
        yield ds.tensors[0][b], ds.tensors[1][b]


def reference(victims, model, optimizer, loss_fn, combine):
    """One process plays 4 ranks: each step every live member's gradient (rank order) goes through
    ``combine(grads, live_count) -> grad`` (per parameter). ``victims``: a rank, gone from step
    KILL_STEP of epoch KILL_EPOCH on, or {rank: step of epoch KILL_EPOCH from which it is gone}; the
    sampler is re-split over the rest at the next epoch. Returns the final parameters."""
    gone_at = victims if isinstance(victims, dict) else {victims: KILL_STEP}
    ds = dataset()
    members = list(range(4))
    samplers = {r: DistributedSampler(ds, num_replicas=4, rank=r, shuffle=True, seed=0) for r in members}
    for epoch in range(EPOCHS):
        if epoch == KILL_EPOCH + 1:
            members = [r for r in members if r not in gone_at]
            samplers = {r: DistributedSampler(ds, num_replicas=len(members), rank=i, shuffle=True, seed=0)
                        for i, r in enumerate(members)}
        iters = {r: batches(ds, samplers[r], epoch) for r in samplers}
        for step, per_rank in enumerate(zip(*iters.values())):
            live = [r for r in iters if not (r in gone_at and (epoch, step) >= (KILL_EPOCH, gone_at[r]))]
            grads = []
            for r, (x, y) in zip(iters, per_rank):
                if r not in live:
                    continue
                model.zero_grad(set_to_none=True)
                loss_fn(model, x, y).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
            for i, p in enumerate(model.parameters()):
                p.grad = combine([g[i] for g in grads], len(live))
            optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _dying_in_backward(loss_fn):
    def dying(model, x, y):
        loss = loss_fn(model, x, y)
        loss.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))  # backward's first hook
        return loss
    return dying


def _kill_self(*_):
    os.kill(os.getpid(), signal.SIGKILL)


def train_killing(trainer, ds, sampler, rank, victims, loss_fn, before_step=None, when="before"):
    """Trains ``trainer`` for EPOCHS epochs. ``victims``: a rank that SIGKILLs itself in step
    KILL_STEP of epoch KILL_EPOCH, or {rank: step of epoch KILL_EPOCH}; ``when`` it dies: "before"
    the step, in its "backward" (after its forward, as its backward begins), or in the
    "replica-update" (ElasticFSDP: as its replica takes the previous step, inside the step's
    gradient exchange, its own gradient shards already handed to the send). ``before_step(epoch,
    step)`` runs on every rank before each step (after the kills). On the survivors, checks one
    recovery per distinct kill step, at that step, and the world size left."""
    kill_at = victims if isinstance(victims, dict) else {victims: KILL_STEP}
    for epoch in range(EPOCHS):
        for step, (x, y) in enumerate(batches(ds, sampler, epoch)):
            fn = loss_fn
            if (epoch, step) == (KILL_EPOCH, kill_at.get(rank)):
                if when == "before":
                    _kill_self()
                elif when == "backward":
                    fn = _dying_in_backward(loss_fn)
                else:
                    trainer.replica.optimizer.register_step_pre_hook(_kill_self)
            if before_step is not None:
                before_step(epoch, step)
            trainer.step(fn, x, y)
    assert trainer.world_size == 4 - len(kill_at) == dist.get_world_size()
    steps = sorted(set(kill_at.values()))
    assert [r["step"] for r in trainer.recoveries] == steps, trainer.recoveries


def wait_for_gone(count):
    """Waits until ``count`` ranks of the default group are gone (several deaths "at once")."""
    from torchdist_ext.elastic import gone_ranks

    while len(gone_ranks()) < count:
        time.sleep(0.01)


def commit_interrupted_here(trainer):
    """This rank's next commit (the one-element all_reduce that ends the replica's gradient exchange)
    completes, but here it fails as if interrupted, once a rank is gone: the others commit that
    step and this rank does not (the failure reached the survivors at different moments)."""
    exchange = trainer.replica.exchange_grads

    def interrupted():
        exchange()
        wait_for_gone(1)
        raise RuntimeError("the commit's all_reduce was interrupted on this rank (the test's)")

    trainer.replica.exchange_grads = interrupted  # the replica is made anew by the recovery


def run_until_refused(step_fn, steps, rank, kill_step, victims=(1, 2)):
    """``step_fn(step)`` for each step; ``victims`` SIGKILL themselves before ``kill_step`` and the
    others wait until all of them are gone. Returns the message of the RuntimeError a survivor's
    step raised, or "finished"."""
    for step in range(steps):
        if step == kill_step:
            if rank in victims:
                os.kill(os.getpid(), signal.SIGKILL)
            wait_for_gone(len(victims))
        try:
            step_fn(step)
        except RuntimeError as error:
            return str(error)
    return "finished"


def assert_neighbours_refused(out, trainer):
    """Ranks 1 and 2 of 4 died together; ranks 0 and 3 got ``trainer``'s error naming them."""
    assert out[1][0] == out[2][0] == "died", out
    for r in (0, 3):
        assert out[r][0] == "ok", f"rank {r}: {out[r]}"
        msg = out[r][1]
        assert f"{trainer}: ranks [1, 2] of 4 died together" in msg, msg
        assert "rank 2 (its replica was on rank 1)" in msg and "Restart from a checkpoint" in msg, msg


def assert_replica_equals(replica, own, where):
    """``replica`` and ``own``: (tensors, optimizer states) of the replica and of what it copies;
    equal bit for bit, Adam state included."""
    (rep_values, rep_states), (own_values, own_states) = replica, own
    assert len(rep_values) == len(own_values) > 0, where
    for i, (a, b) in enumerate(zip(rep_values, own_values)):
        assert torch.equal(a, b), f"{where}: the replica of tensor {i} differs"
    for i, (a, b) in enumerate(zip(rep_states, own_states)):
        assert sorted(a) == sorted(b) == ["exp_avg", "exp_avg_sq", "step"], (where, a.keys(), b.keys())
        for k in a:
            assert torch.equal(a[k], b[k]), f"{where}: the replica of tensor {i}'s {k} differs"


def survivors_of(out, victims):
    """The ranks of ``out`` (run_ranks' results) other than ``victims``; checks that the victims
    died and every survivor returned."""
    for r in victims:
        assert out[r][0] == "died", out[r]
    survivors = [r for r in sorted(out) if r not in victims]
    for r in survivors:
        assert out[r][0] == "ok", f"rank {r}: {out[r]}"
    return survivors
