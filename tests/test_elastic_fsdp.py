"""ElasticFSDP: SIGKILL 1 of 4 ranks mid-epoch under ZeRO stage 3 (and stage 2); the 3 survivors
rebuild the dead rank's shards and Adam state from its neighbour's in-memory replica, re-shard over
3 ranks and finish training in place (no restart, no disk read). Their parameters equal, bit for
bit, a single-process reference that drops the dead rank's data from the failed step on and
re-splits the sampler over 3 ranks at the next epoch: tdx's reduce-scatter folds the gradients in
rank order, which the reference repeats, the rebuild moves values without arithmetic, and Adam
updates elementwise, so sharding changes no rounding. Also: a rank dying in the step, as its backward
begins, or inside its gradient exchange as its replica takes the previous step (the overlapped
refresh); two successive deaths, and two at once that are not ring neighbours (down to 2 ranks, same
reference); a survivor whose commit of a step was interrupted while the others' completed (it
finishes that step itself: stages 1, 2, 3, same reference); 2 simulated hosts (to rounding); the
replica equals the neighbour's shards and optimizer state after every step; two neighbouring ranks
dying together (a shard with no surviving replica) is refused with an error that says so."""
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DistributedSampler

from _dist import run_ranks
from _elastic_runs import (assert_neighbours_refused, assert_replica_equals, batches, commit_interrupted_here, dataset,
                           reference, run_until_refused, survivors_of, train_killing, wait_for_gone)

LR = 0.01


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def _model():
    """6 -> 9 -> 9 -> 9 -> 2: units Block 90 parameters each, the rest 83 (prime): no world size
    3 or 4 divides a flat parameter, so every layout pads its tail."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 9), Block(9), Block(9), nn.Linear(9, 2))


def _optimizer_fn():
    return functools.partial(torch.optim.Adam, lr=LR)


def _loss(model, x, y):
    return nn.functional.mse_loss(model(x), y)


def _fsdp_combine(grads, live):
    """FSDP's reduction: the members' gradients summed in rank order (the order tdx's reduce-scatter
    folds them), the sum divided by their number (as FSDP divides its shard)."""
    total = grads[0].clone()
    for g in grads[1:]:
        total += g
    return total / live


def _mp_loss(model, x, y):
    return nn.functional.mse_loss(model(x).float(), y)


def _mp_reference_loss(model, x, y):
    """What the wrapper with MixedPrecision(bf16, reduce fp32) computes: bf16 parameters and inputs;
    the gradient of the cast is the bf16 gradient cast to fp32, as the wrapper casts it to reduce."""
    low = {n: p.to(torch.bfloat16) for n, p in model.named_parameters()}
    return nn.functional.mse_loss(torch.func.functional_call(model, low, (x.to(torch.bfloat16),)).float(), y)


def _reference(victim, mixed=False):
    """Adam updates elementwise, so sharding the parameters changes nothing in its result."""
    model = _model()
    return reference(victim, model, _optimizer_fn()(model.parameters()), _mp_reference_loss if mixed else _loss,
                     _fsdp_combine)


def _full_params(trainer):
    from torchdist_ext.fsdp import full_state_dict

    return full_state_dict(trainer.model, rank0_only=False)


def _elastic_body(rank, ws, victim, stage, when="before", mixed=False):
    from torchdist_ext import MixedPrecision, ModuleWrapPolicy
    from torchdist_ext.elastic import ElasticFSDP

    ds, model = dataset(), _model()
    sampler = DistributedSampler(ds, num_replicas=ws, rank=rank, shuffle=True, seed=0)
    extra = {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if mixed else {}
    trainer = ElasticFSDP(model, _optimizer_fn(), sampler=sampler, stage=stage,
                          auto_wrap_policy=ModuleWrapPolicy({Block}), **extra)
    optimizer = trainer.optimizer
    train_killing(trainer, ds, sampler, rank, victim, _mp_loss if mixed else _loss, when=when)
    assert trainer.optimizer is optimizer  # re-pointed, not replaced
    params = _full_params(trainer)
    ref = _reference(victim, mixed) if dist.get_rank() == 0 else None
    return params, ref, trainer.recoveries


@pytest.mark.parametrize("stage,victim,when",
                         [(3, 2, "before"), (3, 0, "before"), (2, 3, "before"), (3, 1, "backward"),
                          (1, 1, "backward"), (3, 2, "replica-update")],
                         ids=["stage3-rank2", "stage3-rank0-the-broadcast-source", "stage2-rank3-the-ring-wrap",
                              "stage3-rank1-dies-in-backward", "stage1-rank1-dies-in-backward",
                              "stage3-rank2-dies-in-its-overlapped-replica-update"])
def test_sigkill_one_of_four_ranks_training_finishes_on_three_bit_for_bit(stage, victim, when):
    """Also covers the replica's deferred update: a rank killed before step k leaves its holder with
    step k - 1's update pending (applied before the rebuild); "replica-update" kills the rank in the
    overlapped window itself (its gradient shards handed to the send, the commit not reached)."""
    out = run_ranks(_elastic_body, 4, victim, stage, when, pg_timeout=30.0, expect_failure_ranks=True,
                    timeout=300)
    assert out[victim][0] == "died", out[victim]
    survivors = [r for r in range(4) if r != victim]
    for r in survivors:
        assert out[r][0] == "ok", f"rank {r}: {out[r]}"
    ref = out[survivors[0]][1][1]
    names = [n for n, _ in _model().named_parameters()]
    for r in survivors:
        params = out[r][1][0]
        for name, q in zip(names, ref):
            assert torch.equal(params[name], q), f"rank {r}: {name} differs from the reference"
    assert f"rank {victim} (pid" in out[survivors[0]][1][2][0]["excluded"][0]


def _two_hosts(rank):
    """Ranks 0-1 on simulated host A, 2-3 on host B (tdx's multi-host mode: Gloo between them)."""
    return {"TDX_NODE_ID": f"simhost{rank // 2}"}


@pytest.mark.parametrize("victim", [1, 2], ids=["rank1-hostA-replica-on-rank2", "rank2-hostB-replica-on-rank0"])
def test_sigkill_one_of_four_ranks_across_hosts_training_finishes_on_three(victim):
    """2 simulated hosts x 2 ranks, stage 3; the replica ring alternates hosts (0, 2, 1, 3), so
    every rank's replica lives on the other host (the gradient exchange crosses the Gloo link every
    step). Across hosts the reduce-scatter folds per host first, then Gloo adds the hosts'
    partials, not in rank order: the parameters match the reference to rounding only, and are
    bit-equal on every survivor."""
    out = run_ranks(_elastic_body, 4, victim, 3, pg_timeout=30.0, expect_failure_ranks=True, timeout=300,
                    rank_env=_two_hosts)
    assert out[victim][0] == "died", out[victim]
    survivors = [r for r in range(4) if r != victim]
    for r in survivors:
        assert out[r][0] == "ok", f"rank {r}: {out[r]}"
    ref, first = out[survivors[0]][1][1], out[survivors[0]][1][0]
    names = [n for n, _ in _model().named_parameters()]
    for r in survivors:
        params = out[r][1][0]
        for name, q in zip(names, ref):
            assert torch.equal(params[name], first[name]), f"rank {r}: {name} differs from rank {survivors[0]}"
            torch.testing.assert_close(params[name], q, rtol=1e-5, atol=1e-6)


def _wait_for_both_gone(epoch, step):
    if (epoch, step) == (0, 3):
        wait_for_gone(2)  # both gone before the survivors' step: "at once"


def _several_body(rank, ws, kills):
    from torchdist_ext import ModuleWrapPolicy
    from torchdist_ext.elastic import ElasticFSDP

    ds, model = dataset(), _model()
    sampler = DistributedSampler(ds, num_replicas=ws, rank=rank, shuffle=True, seed=0)
    trainer = ElasticFSDP(model, _optimizer_fn(), sampler=sampler, stage=3, auto_wrap_policy=ModuleWrapPolicy({Block}))
    together = len(set(kills.values())) == 1
    train_killing(trainer, ds, sampler, rank, kills, _loss, _wait_for_both_gone if together else None)
    params = _full_params(trainer)
    ref = _reference(kills) if dist.get_rank() == 0 else None
    return params, ref


@pytest.mark.parametrize("kills", [{3: 2, 0: 4}, {0: 3, 2: 3}],
                         ids=["rank3-then-rank0-successively", "ranks0-and-2-together-not-neighbours"])
def test_several_deaths_on_four_ranks_training_finishes_on_two_bit_for_bit(kills):
    """Successive deaths (the second recovery rebuilds from the replicas of the 3-rank ring), and two
    deaths at once whose holders (rank - 1) both survive."""
    out = run_ranks(_several_body, 4, kills, pg_timeout=30.0, expect_failure_ranks=True, timeout=300)
    survivors = [r for r in range(4) if r not in kills]
    for r in kills:
        assert out[r][0] == "died", out[r]
    for r in survivors:
        assert out[r][0] == "ok", f"rank {r}: {out[r]}"
    ref = out[survivors[0]][1][1]
    names = [n for n, _ in _model().named_parameters()]
    for r in survivors:
        for name, q in zip(names, ref):
            assert torch.equal(out[r][1][0][name], q), f"rank {r}: {name} differs from the reference"


def _one_behind_body(rank, ws, stage):
    from torchdist_ext import ModuleWrapPolicy
    from torchdist_ext.elastic import ElasticFSDP

    ds, model = dataset(), _model()
    sampler = DistributedSampler(ds, num_replicas=ws, rank=rank, shuffle=True, seed=0)
    trainer = ElasticFSDP(model, _optimizer_fn(), sampler=sampler, stage=stage,
                          auto_wrap_policy=ModuleWrapPolicy({Block}))

    def interrupt(epoch, step):
        if rank == 2 and (epoch, step) == (0, 3):
            commit_interrupted_here(trainer)
    train_killing(trainer, ds, sampler, rank, {3: 4}, _loss, interrupt)
    return _full_params(trainer), _reference({3: 4}) if rank == 0 else None, trainer.recoveries


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_survivor_one_step_behind_finishes_that_step_and_training_equals_the_reference(stage):
    """Step 3's commit completes on ranks 0, 1 and 3 and is interrupted on rank 2, the holder of
    rank 3's replica; rank 3 dies before step 4. Rank 2 completes step 3 itself from the gradients
    it holds (its own shards' and, for its replica, rank 3's), so rank 3's shards are rebuilt at
    step 3 too, and training finishes on 3 ranks equal to the reference that drops rank 3 from step 4."""
    out = run_ranks(_one_behind_body, 4, stage, pg_timeout=30.0, expect_failure_ranks=True, timeout=300)
    survivors = survivors_of(out, [3])
    ref = out[0][1][1]
    names = [n for n, _ in _model().named_parameters()]
    for r in survivors:
        params, _, recoveries = out[r][1]
        assert [rec["caught_up"] for rec in recoveries] == [r == 2], (r, recoveries)
        for name, q in zip(names, ref):
            assert torch.equal(params[name], q), f"rank {r}: {name} differs from the reference"


def _replica_body(rank, ws, stage):
    return _replica_run(rank, ws, stage)[1]


def _replica_run(rank, ws, stage):
    """(trainer, [(own shards and state, replica snapshot)] after each of 3 steps)."""
    from torchdist_ext import ModuleWrapPolicy
    from torchdist_ext.elastic import ElasticFSDP

    ds, model = dataset(), _model()
    sampler = DistributedSampler(ds, num_replicas=ws, rank=rank, shuffle=True, seed=0)
    trainer = ElasticFSDP(model, _optimizer_fn(), sampler=sampler, stage=stage,
                          auto_wrap_policy=ModuleWrapPolicy({Block}))
    seen = []
    for step, (x, y) in enumerate(batches(ds, sampler, 0)):
        if step == 3:
            break
        trainer.step(_loss, x, y)
        assert trainer.replica._pending is not None  # the update waits for the next step's exchange
        own = ([u.shard.detach().clone() for u in trainer.model.units],
               [{k: v.clone() for k, v in trainer.optimizer.state[u.shard].items()} for u in trainer.model.units])
        seen.append((own, trainer.replica.snapshot()))
    return trainer, seen


@pytest.mark.parametrize("stage", [1, 3])
def test_replica_equals_the_neighbours_shards_and_optimizer_state_after_every_step(stage):
    out = run_ranks(_replica_body, 4, stage, timeout=240)
    for r in range(4):
        for step, (_, replica) in enumerate(out[r]):
            assert_replica_equals(replica, out[(r + 1) % 4][step][0],
                                  f"step {step}: rank {r}'s replica of rank {(r + 1) % 4}'s shards (one per unit)")


def _neighbours_body(rank, ws):
    from torchdist_ext.elastic import ElasticFSDP

    ds, model = dataset(), _model()
    sampler = DistributedSampler(ds, num_replicas=ws, rank=rank, shuffle=True, seed=0)
    trainer = ElasticFSDP(model, _optimizer_fn(), sampler=sampler, stage=3)
    steps = list(batches(ds, sampler, 0))
    return run_until_refused(lambda step: trainer.step(_loss, *steps[step]), len(steps), rank, 3)


def test_two_neighbouring_ranks_dying_together_is_refused_with_a_clear_error():
    out = run_ranks(_neighbours_body, 4, pg_timeout=30.0, expect_failure_ranks=True, timeout=240)
    assert_neighbours_refused(out, "ElasticFSDP")


def test_mixed_precision_bf16_compute_sigkill_one_of_four_bit_for_bit():
    """MixedPrecision(param_dtype=bf16, reduce_dtype=fp32), stage 3: the replica exchanges and steps
    the fp32 master gradients and shards, so the recovery is as exact as in fp32: the survivors
    equal a reference that computes in bf16 the same way (bf16 parameters and inputs, gradients
    cast to fp32, summed in rank order)."""
    out = run_ranks(_elastic_body, 4, 2, 3, "before", True, pg_timeout=30.0, expect_failure_ranks=True,
                    timeout=300)
    assert out[2][0] == "died", out[2]
    names = [n for n, _ in _model().named_parameters()]
    ref = out[0][1][1]
    for r in (0, 1, 3):
        assert out[r][0] == "ok", f"rank {r}: {out[r]}"
        for name, q in zip(names, ref):
            assert out[r][1][0][name].dtype == torch.float32
            assert torch.equal(out[r][1][0][name], q), f"rank {r}: {name} differs from the bf16 reference"


def test_cpu_offload_is_refused_with_an_error_naming_it():
    from torchdist_ext.elastic import ElasticFSDP

    with pytest.raises(ValueError, match=r"cpu_offload=True is not supported"):
        ElasticFSDP(nn.Linear(2, 2), _optimizer_fn(), cpu_offload=True)
