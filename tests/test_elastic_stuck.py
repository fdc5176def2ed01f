"""A stuck rank is a failed rank: under ElasticDDP on one host, a rank of 4 that is alive but makes
no progress (SIGSTOPped, or sleeping in its step) is excluded after TDX_FAILURE_DETECTION_S; the 3
survivors finish training bit for bit equal to the reference that drops that rank from the same
step; the stuck rank, once it runs again, fails its next call on the old group saying it was
excluded, finds no segment of the new group to map, and nothing is left in /dev/shm. With the store
in etcd (one local member), its store writes fail too: the survivors revoked its liveness lease."""
import glob
import os
import signal
import tempfile
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from _dist import run_ranks
from _etcd import LocalEtcd
from _elastic_runs import EPOCHS, KILL_EPOCH, KILL_STEP, batches, dataset
from test_elastic_ddp import LR, _loss, _model, _reference

STUCK_S = 3.0  # TDX_FAILURE_DETECTION_S in these runs
VICTIM = 2
EXCLUDED = "was excluded from the group after making no progress for"


def _sleeping(loss_fn):
    def sleeping(model, x, y):
        time.sleep(STUCK_S + 3.0)  # a hang in user code, in the step, before its first collective
        return loss_fn(model, x, y)
    return sleeping


def _segments_of(pids):
    return [p for p in glob.glob("/dev/shm/tdx-*") if p.split("-")[1] in {str(pid) for pid in pids}]


def _after_exclusion(error, pids, flag, store):
    """The excluded rank runs again: it tries the old group and the new group's memory."""
    tries = {"error": str(error)}
    for what, call in (("all_reduce", lambda: dist.all_reduce(torch.ones(4))),
                       ("send", lambda: dist.send(torch.ones(4), dst=0))):
        try:
            call()
            tries[what] = "succeeded"
        except RuntimeError as e:
            tries[what] = str(e)
    # The survivors' new group is alive (they wait for the flag): its segments exist, but their names
    # are unlinked once every survivor mapped them, so there is nothing this rank could open.
    survivors = [pid for r, pid in enumerate(pids) if r != VICTIM]
    tries["segments"] = _segments_of(survivors)
    if store is not None:
        try:
            store.set("written-by-the-excluded-rank", "1")
            tries["store"] = "succeeded"
        except RuntimeError as e:
            tries["store"] = str(e)
    with open(flag, "w") as f:
        f.write("done")
    return tries


def _stuck_body(rank, ws, how, flag, url):
    from torchdist_ext.elastic import ElasticDDP, RankExcludedError

    store = None
    if url is not None:
        from torchdist_ext.etcd_store import EtcdStore

        store = EtcdStore(url, timeout=60)
        dist.init_process_group("tdx", store=store, rank=rank, world_size=ws, timeout=timedelta(seconds=60))
    pids = [None] * ws
    dist.all_gather_object(pids, os.getpid())
    ds, model = dataset(), _model()
    sampler = DistributedSampler(ds, num_replicas=ws, rank=rank, shuffle=True, seed=0)
    trainer = ElasticDDP(model, torch.optim.SGD(model.parameters(), lr=LR), sampler=sampler)
    continued = False
    try:
        for epoch in range(EPOCHS):
            for step, (x, y) in enumerate(batches(ds, sampler, epoch)):
                fn = _loss
                if rank == VICTIM and (epoch, step) == (KILL_EPOCH, KILL_STEP):
                    if how == "sigstop":
                        os.kill(os.getpid(), signal.SIGSTOP)  # rank 0 sends SIGCONT after the recovery
                    else:
                        fn = _sleeping(_loss)
                trainer.step(fn, x, y)
                if how == "sigstop" and rank == 0 and trainer.recoveries and not continued:
                    os.kill(pids[VICTIM], signal.SIGCONT)  # it runs again while the survivors train on
                    continued = True
    except RankExcludedError as error:
        if rank != VICTIM:
            raise
        if how == "sleep" and url is None:
            raise  # uncaught: the process exits with it (run_ranks reports it as this rank's error)
        return _after_exclusion(error, pids, flag, store)
    assert rank != VICTIM, "the stuck rank was never excluded"
    if store is not None:
        store.set(f"written-by-survivor-{rank}", "1")  # the survivors' own writes go on
    if how == "sigstop" or url is not None:  # keep the new group alive until the excluded rank has tried it
        deadline = time.monotonic() + 60
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)
    ref = _reference(VICTIM) if rank == 0 else None
    return [p.detach().clone() for p in model.parameters()], ref, trainer.recoveries, pids


@pytest.mark.parametrize("how", ["sigstop", "sleep", "sleep-etcd"])
def test_a_stuck_rank_of_four_is_excluded_fenced_and_the_survivors_finish_bit_for_bit(how):
    flag = os.path.join(tempfile.mkdtemp(prefix="tdx-stuck-"), "tried")
    etcd = None
    if how == "sleep-etcd":
        from _etcd import unavailable_reason

        reason = unavailable_reason()
        if reason:
            pytest.skip(reason)
        etcd = LocalEtcd()
    try:
        out = run_ranks(_stuck_body, 4, how.split("-")[0], flag, etcd and etcd.url, pg_timeout=60.0, timeout=180,
                        expect_failure_ranks=True, env={"TDX_FAILURE_DETECTION_S": STUCK_S},
                        backend=None if etcd else "tdx")
    finally:
        if etcd is not None:
            etcd.close()
    survivors = [r for r in range(4) if r != VICTIM]
    for r in survivors:
        assert out[r][0] == "ok", f"rank {r}: {out[r]}"
    ref = out[0][1][1]
    for r in survivors:
        params, _, recoveries, pids = out[r][1]
        assert all(torch.equal(p, q) for p, q in zip(params, ref)), f"rank {r} differs from the reference"
        assert len(recoveries) == 1 and recoveries[0]["world_size"] == 3, recoveries
        assert f"rank {VICTIM}: rank {VICTIM} (pid {pids[VICTIM]}) {EXCLUDED}" in recoveries[0]["excluded"][0], recoveries
    if how == "sleep":
        status, trace = out[VICTIM]
        assert status == "error" and "RankExcludedError" in trace and EXCLUDED in trace, out[VICTIM]
    else:
        status, tries = out[VICTIM]
        assert status == "ok", out[VICTIM]
        assert EXCLUDED in tries["error"] and "must exit" in tries["error"], tries
        for what in ("all_reduce", "send"):
            assert EXCLUDED in tries[what] and "refused on rank 2" in tries[what], (what, tries[what])
        assert tries["segments"] == [], tries
        if etcd is not None:
            assert "write of 'written-by-the-excluded-rank' refused" in tries["store"], tries
            assert "lease was revoked" in tries["store"], tries
    assert _segments_of(pids) == [], "tdx segments left in /dev/shm"
