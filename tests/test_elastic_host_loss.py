"""A whole host lost under ElasticDDP and ElasticFSDP, with the store in etcd (TDX_STORE): the others go on.

3 test hosts, an etcd member on each (tests/_etcd.py); 4 ranks: 0 and 1 on hostA, 2 on hostB, 3 on
hostC. Both ranks of hostA SIGKILL themselves before step 3 of epoch 0, then the test SIGKILLs
everything else on hostA (its etcd member, the leader). No host mate survives to leave a note, so
the survivors learn it from the liveness watch (torchdist_ext/elastic/_watch.py: the ranks'
liveness connections close, their leases in etcd are revoked; the group timeout, 600 s, exceeds the test's deadline, so a survivor
that learnt of the loss only at the timeout fails the test), shrink hostA out, rebuild DDP (or FSDP's shards and Adam state, from
the replicas that the replica ring put on hostB and hostC) and finish on 2 ranks. Their parameters
are bit-equal to each other and equal, to rounding (across hosts the reduction folds per host,
then across hosts), a single-process reference that drops ranks 0 and 1 from that step on and
re-splits the sampler at the next epoch.
"""
import glob
import time

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from _elastic_runs import KILL_STEP, dataset, train_killing
from test_elastic_ddp import LR, _loss, _model, _reference
from test_etcd_store import cluster, start_ranks  # noqa: F401  (cluster: the fixture)

LOST = {0: KILL_STEP, 1: KILL_STEP}


def _ddp_job(rank, ws):
    from torchdist_ext.elastic import ElasticDDP

    ds, model = dataset(), _model()
    sampler = DistributedSampler(ds, num_replicas=ws, rank=rank, shuffle=True, seed=0)
    trainer = ElasticDDP(model, torch.optim.SGD(model.parameters(), lr=LR), sampler=sampler)
    train_killing(trainer, ds, sampler, rank, LOST, _loss)
    ref = _reference(LOST) if dist.get_rank() == 0 else None
    return [p.detach().clone() for p in model.parameters()], ref, trainer.recoveries


def _fsdp_job(rank, ws):
    """ElasticFSDP stage 3 with Adam: the replica ring is 0 2 1 3 (hosts A A B C), so hostA's
    ranks 0 and 1 have their replicas on rank 3 (hostC) and rank 2 (hostB)."""
    from test_elastic_fsdp import _elastic_body

    params, ref, recoveries = _elastic_body(rank, ws, LOST, 3)
    names = [n for n, _ in _model_fsdp().named_parameters()]
    return ([params[n] for n in names], ref, recoveries)


def _model_fsdp():
    from test_elastic_fsdp import _model as model

    return model()


@pytest.mark.parametrize("job", ["_ddp_job", "_fsdp_job"], ids=["ElasticDDP", "ElasticFSDP-stage3"])
def test_elastic_trainer_survives_the_loss_of_a_whole_host(cluster, tmp_path, job):  # noqa: F811
    hosts, etcd = cluster
    out, procs = start_ranks(hosts, etcd, tmp_path, f"test_elastic_host_loss:{job}",
                             env={"TDX_FAILURE_DETECTION_S": 5, "TDX_TEST_PG_TIMEOUT": 600})
    hosts.wait(procs[:2], timeout=240)  # hostA's ranks kill themselves at the step
    hosts.kill("hostA")  # and everything left there: a whole host lost
    started = time.monotonic()
    codes = hosts.wait(procs[2:], timeout=240)
    errors = [open(p).read() for p in sorted(glob.glob(str(out / "rank*.err")))]
    if errors or codes != [0, 0]:
        logs = "\n".join(f"--- {p} ---\n{open(p).read()[-3000:]}" for p in sorted(glob.glob(str(tmp_path / "*.log"))))
        pytest.fail(f"survivors exited {codes}\n" + "\n".join(errors) + logs + etcd.logs())
    runs = {r: torch.load(out / f"rank{r}.pt", weights_only=False) for r in (2, 3)}
    params2, ref, recoveries = runs[2]["result"]
    params3 = runs[3]["result"][0]
    assert all(torch.equal(p, q) for p, q in zip(params2, params3)), "the survivors differ"
    for p, q in zip(params2, ref):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert [r["step"] for r in recoveries] == [KILL_STEP] and recoveries[0]["world_size"] == 2, recoveries
    # Told by the liveness connections that closed with hostA's processes (or a port there that refused one).
    assert all("liveness connection closed" in why or "liveness port" in why for why in recoveries[0]["excluded"]), \
        recoveries
    print(f"recovery: {recoveries[0]['seconds']:.2f} s; survivors done {time.monotonic() - started:.1f} s "
          "after hostA was killed")
