"""ElasticPipeline: SIGKILL 1 of 4 stage ranks mid-training (a middle stage under 1F1B, stage 0
under GPipe, the last stage under 1F1B); the 3 survivors reassemble the model and Adam state from
their own stages plus the dead stage's replica on its holder (the rank before it on the ring), re-split it over 3 stages
and finish in place (no restart, no disk read). Every step trains on the whole batch, so nothing
of the data is lost: the final parameters equal, bit for bit, one process training the unsplit
model on the same micro-batches (each micro-batch's loss / m, backward in micro-batch order, the
order in which both schedules accumulate a stage's gradients; weight gradients are not batched,
batch_weight_grads=False; Adam is elementwise, and the reassembly moves values without arithmetic).
Also: a stage whose commit of a step was interrupted while the others' completed finishes that step
itself (the same bit-for-bit reference); the replica equals the next stage's parameters and Adam
state after every step; two ring neighbours dying together is refused with an error naming them;
nothing is left in /dev/shm."""
import functools
import glob
import os
import signal

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _dist import run_ranks
from _elastic_runs import (assert_neighbours_refused, assert_replica_equals, commit_interrupted_here, run_until_refused,
                           survivors_of)

LR, BATCH, M, STEPS, KILL_STEP = 0.01, 8, 4, 6, 3


class Block(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)

    def forward(self, x):
        return torch.tanh(self.fc(x))


def _model():
    """7 layers with parameters, so that every split over 2 to 4 stages gives each some."""
    torch.manual_seed(1)
    return nn.Sequential(Block(6, 12), Block(12, 12), Block(12, 10), Block(10, 12), Block(12, 12), Block(12, 8),
                         nn.Linear(8, 2))


def _optimizer_fn():
    return functools.partial(torch.optim.Adam, lr=LR)


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 2, generator=g)


def _reference(steps=STEPS):
    """The unsplit model in one process: per step, each micro-batch's loss / M backward in order, Adam."""
    model = _model()
    opt = _optimizer_fn()(model.parameters())
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad(set_to_none=True)
        for xm, ym in zip(x.chunk(M), y.chunk(M)):
            (nn.functional.mse_loss(model(xm), ym) / M).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _trainer(schedule):
    from torchdist_ext.elastic import ElasticPipeline
    from torchdist_ext.pipeline import Schedule1F1B, ScheduleGPipe

    cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    return ElasticPipeline(_model(), _optimizer_fn(), M, nn.functional.mse_loss, schedule=cls,
                           batch_weight_grads=False)


def _own_params(trainer):
    return {n: p.detach().clone() for n, p in trainer.parts[trainer.rank].named_parameters()}


def _kill_body(rank, ws, victim, schedule):
    trainer = _trainer(schedule)
    optimizer = trainer.optimizer
    for step in range(STEPS):
        if rank == victim and step == KILL_STEP:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = _batch(step)
        trainer.step(x, target=y)
    assert trainer.world_size == 3 == dist.get_world_size()
    assert [r["step"] for r in trainer.recoveries] == [KILL_STEP], trainer.recoveries
    assert trainer.optimizer is optimizer  # re-pointed, not replaced
    ref = _reference() if dist.get_rank() == 0 else None
    return _own_params(trainer), ref, trainer.recoveries


def _segments():
    return set(glob.glob("/dev/shm/tdx-*"))


def _alive(segment):
    """Segments are named tdx-<creator pid>-<random>: another job's segment has a live creator."""
    try:
        os.kill(int(os.path.basename(segment).split("-")[1]), 0)
    except (IndexError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


@pytest.mark.parametrize("victim,schedule", [(2, "1f1b"), (0, "gpipe"), (3, "1f1b")],
                         ids=["middle-stage2-1f1b", "stage0-gpipe", "last-stage3-1f1b-the-ring-wrap"])
def test_sigkill_one_of_four_stages_training_finishes_on_three_bit_for_bit(victim, schedule):
    before = _segments()
    out = run_ranks(_kill_body, 4, victim, schedule, pg_timeout=60.0, expect_failure_ranks=True, timeout=300)
    assert out[victim][0] == "died", out[victim]
    survivors = [r for r in range(4) if r != victim]
    for r in survivors:
        assert out[r][0] == "ok", f"rank {r}: {out[r]}"
    ref = next(out[r][1][1] for r in survivors if out[r][1][1] is not None)
    merged = {}
    for r in survivors:
        for name, value in out[r][1][0].items():
            assert name not in merged, f"{name} is on two stages"
            merged[name] = value
    assert sorted(merged) == sorted(ref), (sorted(merged), sorted(ref))
    for name, want in ref.items():
        assert torch.equal(merged[name], want), f"{name} differs from the reference"
    assert f"rank {victim} (pid" in out[survivors[0]][1][2][0]["excluded"][0]
    left = [s for s in _segments() - before if not _alive(s)]
    assert not left, f"tdx segments left in /dev/shm: {left}"


def _one_behind_body(rank, ws):
    trainer = _trainer("1f1b")
    for step in range(STEPS):
        if rank == 3 and step == KILL_STEP + 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == 2 and step == KILL_STEP:
            commit_interrupted_here(trainer)
        x, y = _batch(step)
        trainer.step(x, target=y)
    return _own_params(trainer), trainer.recoveries


def test_a_survivor_one_step_behind_finishes_that_step_bit_for_bit():
    """Step 3's commit completes on stages 0, 1 and 3 and is interrupted on stage 2, the holder of
    stage 3's replica; stage 3 dies before step 4. Stage 2 completes step 3 itself from the
    gradients it holds (its own stage's and stage 3's), so stage 3 is rebuilt at step 3 too, and the
    survivors together equal, bit for bit, the unsplit model trained on every step."""
    out = run_ranks(_one_behind_body, 4, pg_timeout=60.0, expect_failure_ranks=True, timeout=300)
    survivors = survivors_of(out, [3])
    merged = {}
    for r in survivors:
        params, recoveries = out[r][1]
        assert [rec["caught_up"] for rec in recoveries] == [r == 2], (r, recoveries)
        assert [rec["step"] for rec in recoveries] == [KILL_STEP + 1], (r, recoveries)
        assert not set(params) & set(merged), f"rank {r}: {sorted(set(params) & set(merged))} are on two stages"
        merged.update(params)
    ref = _reference()
    assert sorted(merged) == sorted(ref), (sorted(merged), sorted(ref))
    for name, want in ref.items():
        assert torch.equal(merged[name], want), f"{name} differs from the reference"


def _replica_body(rank, ws):
    trainer = _trainer("1f1b")
    seen = []
    for step in range(3):
        x, y = _batch(step)
        trainer.step(x, target=y)
        own = list(trainer.parts[rank].parameters())
        seen.append((([p.detach().clone() for p in own],
                      [{k: v.clone() for k, v in trainer.optimizer.state[p].items()} for p in own]),
                     trainer.replica.snapshot()))
    return seen


def test_replica_equals_the_next_stage_and_its_optimizer_state_after_every_step():
    out = run_ranks(_replica_body, 4, timeout=240)
    for r in range(4):
        for step, (_, replica) in enumerate(out[r]):
            assert_replica_equals(replica, out[(r + 1) % 4][step][0],
                                  f"step {step}: rank {r}'s replica of stage {(r + 1) % 4}'s parameters")


def _neighbours_body(rank, ws):
    trainer = _trainer("1f1b")

    def step(i):
        x, y = _batch(i)
        trainer.step(x, target=y)
    return run_until_refused(step, STEPS, rank, KILL_STEP)


def test_two_neighbouring_stages_dying_together_is_refused_with_a_clear_error():
    out = run_ranks(_neighbours_body, 4, pg_timeout=60.0, expect_failure_ranks=True, timeout=240)
    assert_neighbours_refused(out, "ElasticPipeline")
