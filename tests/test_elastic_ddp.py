"""ElasticDDP: SIGKILL 1 of 4 ranks mid-epoch; the 3 survivors finish training in place (no restart,
no disk read) and their parameters equal, bit for bit, a single-process reference that drops the
dead rank's data from the failed step on and re-splits the sampler over 3 ranks at the next epoch."""
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from _dist import run_ranks
from _elastic_runs import dataset, reference, train_killing

LR = 0.05


def _model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def _ddp_combine(grads, live):
    """DDP's reduction: each member's gradient times 1/world size, summed in rank order."""
    scale = torch.tensor(1.0 / live, dtype=torch.float32)
    total = None
    for g in grads:
        total = g * scale if total is None else total + g * scale
    return total


def _reference(victim):
    model = _model()
    return reference(victim, model, torch.optim.SGD(model.parameters(), lr=LR), _loss, _ddp_combine)


def _elastic_body(rank, ws, victim):
    from torchdist_ext.elastic import ElasticDDP

    ds, model = dataset(), _model()
    sampler = DistributedSampler(ds, num_replicas=ws, rank=rank, shuffle=True, seed=0)
    trainer = ElasticDDP(model, torch.optim.SGD(model.parameters(), lr=LR), sampler=sampler)
    train_killing(trainer, ds, sampler, rank, victim, _loss)
    ref = _reference(victim) if dist.get_rank() == 0 else None
    params = [p.detach().clone() for p in model.parameters()]
    return params, ref, trainer.recoveries


@pytest.mark.parametrize("victim", [2, 0], ids=["rank2", "rank0-the-broadcast-source"])
def test_sigkill_one_of_four_ranks_training_finishes_on_three_bit_for_bit(victim):
    out = run_ranks(_elastic_body, 4, victim, pg_timeout=30.0, expect_failure_ranks=True, timeout=240)
    assert out[victim][0] == "died", out[victim]
    survivors = [r for r in range(4) if r != victim]
    for r in survivors:
        assert out[r][0] == "ok", f"rank {r}: {out[r]}"
    ref = out[survivors[0]][1][1]
    for r in survivors:
        params = out[r][1][0]
        assert all(torch.equal(p, q) for p, q in zip(params, ref)), f"rank {r} differs from the reference"
    assert f"rank {victim} (pid" in out[survivors[0]][1][2][0]["excluded"][0]


def _two_hosts(rank):
    """Ranks 0-1 on simulated host A, 2-3 on host B (tdx's multi-host mode: Gloo between them)."""
    return {"TDX_NODE_ID": f"simhost{rank // 2}"}


@pytest.mark.parametrize("victim", [3, 0], ids=["rank3", "rank0-the-broadcast-source"])
def test_sigkill_one_of_four_ranks_across_hosts_training_finishes_on_three(victim):
    """2 simulated hosts x 2 ranks. Across hosts the reduction folds per host first (then Gloo
    adds the hosts' partials), not in rank order, so the parameters match the reference to
    rounding, and are bit-equal on every survivor."""
    out = run_ranks(_elastic_body, 4, victim, pg_timeout=30.0, expect_failure_ranks=True, timeout=240,
                    rank_env=_two_hosts)
    assert out[victim][0] == "died", out[victim]
    survivors = [r for r in range(4) if r != victim]
    for r in survivors:
        assert out[r][0] == "ok", f"rank {r}: {out[r]}"
    ref = out[survivors[0]][1][1]
    first = out[survivors[0]][1][0]
    for r in survivors:
        params = out[r][1][0]
        assert all(torch.equal(p, q) for p, q in zip(params, first)), f"rank {r} differs from rank {survivors[0]}"
        for p, q in zip(params, ref):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert f"rank {victim} (pid" in out[survivors[0]][1][2][0]["excluded"][0]


def _one_ahead_body(rank, ws):
    import os
    import signal

    from torchdist_ext.elastic import ElasticDDP

    model = _model()
    trainer = ElasticDDP(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    g = torch.Generator().manual_seed(rank)
    batch = [(torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)) for _ in range(8)]
    for x, y in batch[:2]:
        trainer.step(_loss, x, y)
    dist.barrier()
    if rank == 1:  # its step 3 completed here but not on rank 0: it stepped once more (local gradients)
        trainer.optimizer.zero_grad()
        _loss(trainer.module, *batch[2]).backward()
        trainer.optimizer.step()
        trainer.steps_done += 1
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    returned = []
    while trainer.steps_done < 5:
        loss = trainer.step(_loss, *batch[trainer.steps_done])
        returned.append((trainer.steps_done, loss is None))
    momentum = [trainer.optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    return [p.detach().clone() for p in model.parameters()], momentum, trainer.recoveries, returned


def test_a_survivor_one_step_behind_takes_the_state_of_the_one_ahead():
    """A collective can complete on one survivor and fail on another: the one behind takes the
    parameters and optimizer state of the lowest rank ahead (not rank 0's: DDP's own broadcast
    source) and counts that step as done; both go on together, equal."""
    out = run_ranks(_one_ahead_body, 3, expect_failure_ranks=[2], timeout=240)
    assert out[2][0] == "died", out[2]
    (p0, m0, rec0, ret0), (p1, m1, rec1, ret1) = out[0][1], out[1][1]
    assert all(torch.equal(a, b) for a, b in zip(p0, p1)) and all(torch.equal(a, b) for a, b in zip(m0, m1))
    assert [r["caught_up"] for r in rec0] == [True] and [r["caught_up"] for r in rec1] == [False], (rec0, rec1)
    assert ret0 == [(3, True), (4, False), (5, False)] and ret1 == [(4, False), (5, False)], (ret0, ret1)
    assert not all(torch.equal(a, b) for a, b in zip(p0, _model().parameters()))  # it trained
