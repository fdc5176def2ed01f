"""A job that ended admits nobody: a joiner (or a relaunched command) is told, not left waiting.

A job's rank 0 marks it running in its store (``tdx/rejoin/gen``) and the mark outlives the job. In
etcd every elastic rank also keeps a liveness key under ``tdx/alive/`` while its process lives;
without one, ``job_running`` is False (the same ``torchdist_ext.run --keep-survivors`` command then
starts a new job instead of joining a finished one) and a joiner already waiting raises within
seconds instead of waiting its whole ``wait``. One etcd member on 127.0.0.1 (tests/_etcd.py);
skips with the reason where etcd cannot run.
"""
import os
import subprocess
import sys
from datetime import timedelta

import pytest

from _etcd import LocalEtcd
from _etcd import unavailable_reason as etcd_unavailable_reason


@pytest.fixture
def store():
    reason = etcd_unavailable_reason()
    if reason:
        pytest.skip(reason)
    from torchdist_ext.etcd_store import EtcdStore

    with LocalEtcd("ended-job") as etcd:
        yield etcd.url, EtcdStore(f"{etcd.url}/attempt0", timeout=30)  # torchrun's first attempt


def test_a_job_without_a_live_member_is_not_running_and_a_joiner_is_told(store):
    url, store = store
    from torchdist_ext.elastic._rejoin import job_running, members_alive, rejoin
    from torchdist_ext.run import _running_job_store

    assert members_alive(store) is False and not job_running(store)  # nothing marked yet
    store.set("tdx/rejoin/gen", "0")
    lease = store._client.lease(30)
    store._client.put(store._key("tdx/alive/g0/0"), "rank 0", lease=lease)  # _watch.alive_key(0, 0)
    assert members_alive(store) and job_running(store) and _running_job_store(url, 0) == 0  # the launcher joins
    lease.revoke()  # what etcd does when the last member's lease expires after the job ended
    assert members_alive(store) is False and not job_running(store) and _running_job_store(url, 0) is None
    with pytest.raises(RuntimeError, match=r"no member of the job is alive .* before admitting this process "
                                           r"\(ticket 1\)"):
        rejoin(store, wait=timedelta(seconds=60))


def test_a_worker_started_to_join_an_ended_job_fails_instead_of_training_alone(store):
    """``torchdist_ext.run --keep-survivors`` starts a host's workers as joiners with placeholder
    RANK/WORLD_SIZE; when the job ends before such a worker reaches ``init_distributed``, it must
    fail with the reason, not start a one-host job of its own."""
    url, store = store
    store.set("tdx/rejoin/gen", "0")  # the job ran: its mark stays, its members are gone
    env = dict(os.environ, TDX_STORE=url, TORCHELASTIC_RESTART_COUNT="0", TDX_JOIN_RUNNING_JOB="1", RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    proc = subprocess.run([sys.executable, "-c", "import torchdist_ext; torchdist_ext.init_distributed(); "
                           "print('trained alone')"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "trained alone" not in proc.stdout, proc.stdout + proc.stderr
    assert "was started to join the running job" in proc.stderr and "no member of it is alive" in proc.stderr, \
        proc.stderr


def _fresh_job_on_a_used_store(rank, ws):
    import torch.distributed as dist

    from _elastic_runs import batches, dataset
    from test_elastic_rejoin import _loss, _trainer
    from torchdist_ext.elastic._rejoin import base_store

    store = base_store()
    if rank == 0:  # what an earlier job on the same store left: 3 tickets handed out, generation 2
        store.add("tdx/rejoin/count", 3)
        store.set("tdx/rejoin/gen", "2")
    dist.barrier()
    ds = dataset()
    trainer, sampler = _trainer("ddp", ds, ws, rank)
    for x, y in batches(ds, sampler, 0):
        trainer.step(_loss, x, y)
    return trainer.generation, trainer.rejoins, trainer.world_size, trainer.steps_done, store.get("tdx/rejoin/gen")


def test_a_fresh_job_on_a_store_an_earlier_job_used_admits_none_of_its_tickets():
    """A requeued job meets on the same store prefix: the earlier run's tickets are not joiners of
    this one (admitting them would wait for processes that are gone), and its generations' keys are
    not met again (the next admission re-forms under a new ``tdx/gen<g>/``)."""
    from _dist import run_ranks

    out = run_ranks(_fresh_job_on_a_used_store, 2, timeout=240)
    assert all(o[:3] == (2, [], 2) and o[3] > 0 and o[4] == b"2" for o in out), out
