"""Elastic recovery across real hosts: 2 test hosts x 2 ranks (tests/_testhosts.py), with
dist.shrink_group, ElasticDDP and ElasticFSDP.

The ranks run as plain processes (torchrun's agent would stop the survivors when a rank dies),
rendezvous through a TCPStore that rank 0 hosts on hostA; the victim is rank 3 or 2 (hostB) or
rank 1 (hostA). A rank of the other host learns which rank died from the note its host mate leaves in
the store; the host parts
shrink in shared memory and the Gloo part is re-formed among the survivors.
"""
import glob
import itertools
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from test_elastic import _check_new_group
from test_elastic_ddp import _elastic_body
from test_elastic_fsdp import _elastic_body as _fsdp_body
from test_elastic_fsdp import _model as _fsdp_model
from _testhosts import TestHosts, unavailable_reason

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
_ports = itertools.count(29611)


@pytest.fixture(scope="module")
def hosts():
    with TestHosts(2) as h:
        yield h


def _start(hosts, tmp_path, target, *args, pg_timeout=600, host_of=lambda rank: rank // 2):
    """Ranks 0-1 on hostA, 2-3 on hostB (or the host index ``host_of(rank)``), each running
    tests/_hostjob.py (env:// rendezvous).

    The group timeout exceeds _collect's deadline: a survivor that learnt of the failure only at
    the timeout (a Gloo wait on a live rank that left the operation) fails the test."""
    out = tmp_path / "out"
    out.mkdir()
    port = next(_ports)
    procs = []
    for rank in range(4):
        env = {"PYTHONPATH": os.pathsep.join([REPO, HERE]), "TDX_TEST_PG_TIMEOUT": pg_timeout,
               "OMP_NUM_THREADS": 1, "MASTER_ADDR": hosts.hosts[0].name, "MASTER_PORT": port, "RANK": rank,
               "WORLD_SIZE": 4, "LOCAL_RANK": sum(host_of(r) == host_of(rank) for r in range(rank)),
               "LOCAL_WORLD_SIZE": sum(host_of(r) == host_of(rank) for r in range(4))}
        with open(tmp_path / f"rank{rank}.log", "w") as log:
            procs.append(hosts.popen(host_of(rank), [sys.executable, os.path.join(HERE, "_hostjob.py"), str(out), target,
                                                 *map(str, args)], env=env, stdout=log, stderr=subprocess.STDOUT))
    return out, procs


def _collect(hosts, tmp_path, out, procs, victim, timeout=240):
    """The survivors' results; fails with every rank's traceback and log."""
    hosts.wait(procs, timeout=timeout)
    survivors = [r for r in range(4) if r != victim]
    errors = [open(p).read() for p in sorted(glob.glob(str(out / "rank*.err")))]
    missing = [r for r in survivors if not (out / f"rank{r}.pt").exists()]
    if errors or missing:
        logs = "\n".join(f"--- {p} ---\n{open(p).read()[-3000:]}" for p in sorted(glob.glob(str(tmp_path / "rank*.log"))))
        pytest.fail(f"no result from ranks {missing}\n" + "\n".join(errors) + logs)
    assert procs[victim].returncode == -signal.SIGKILL, procs[victim].returncode
    for h in hosts.hosts:
        assert not hosts.shm_files(h.index), f"{h.name}'s /dev/shm still holds {hosts.shm_files(h.index)}"
    return {r: torch.load(out / f"rank{r}.pt", weights_only=False) for r in survivors}


def _shrink_job(rank, ws, victim):
    from torchdist_ext import elastic

    victim = int(victim)
    dist.all_reduce(torch.ones(8))
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    with pytest.raises(dist.DistBackendError):
        dist.all_reduce(torch.ones(1 << 16))
    gone = elastic.gone_ranks()
    new = dist.shrink_group(sorted(gone), shrink_flags=1)  # SHRINK_ABORT
    survivors = [r for r in range(ws) if r != victim]
    _check_new_group(new, survivors)
    return {"gone": gone, "rank": new.rank(), "size": new.size()}


@pytest.mark.parametrize("victim", [3, 1])
def test_shrink_group_across_real_hosts_after_a_rank_is_killed(hosts, tmp_path, victim):
    out, procs = _start(hosts, tmp_path, "test_elastic_hosts:_shrink_job", victim)
    runs = _collect(hosts, tmp_path, out, procs, victim)
    for r, run in runs.items():
        res = run["result"]
        assert list(res["gone"]) == [victim] and f"rank {victim} (pid" in res["gone"][victim], res["gone"]
        assert (res["rank"], res["size"]) == (r - (r > victim), 3), res
    assert sorted(run["host"] for run in runs.values()) == sorted(["hostA", "hostB", "hostA" if victim > 1 else "hostB"])


def _elastic_job(rank, ws, victim):
    return _elastic_body(rank, ws, int(victim))


@pytest.mark.parametrize("victim", [3, 1])
def test_elastic_ddp_across_real_hosts_sigkill_one_of_four(hosts, tmp_path, victim):
    """Training finishes on 3 ranks; parameters equal on every survivor, and equal the single-process
    reference to rounding (across hosts the reduction folds per host, then across hosts)."""
    out, procs = _start(hosts, tmp_path, "test_elastic_hosts:_elastic_job", victim)
    runs = _collect(hosts, tmp_path, out, procs, victim)
    params0, ref, recoveries = runs[0]["result"]
    assert f"rank {victim} (pid" in recoveries[0]["excluded"][0], recoveries
    for r, run in runs.items():
        params = run["result"][0]
        assert all(torch.equal(p, q) for p, q in zip(params, params0)), f"rank {r} differs from rank 0"
        for p, q in zip(params, ref):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _fsdp_job(rank, ws, victim, stage):
    return _fsdp_body(rank, ws, int(victim), int(stage))


@pytest.mark.parametrize("stage,victim", [(3, 2), (3, 1), (1, 3)],
                         ids=["stage3-rank2-hostB-replica-on-rank0-hostA", "stage3-rank1-hostA-replica-on-rank2-hostB",
                              "stage1-rank3-hostB-replica-on-rank1-hostA"])
def test_elastic_fsdp_across_real_hosts_sigkill_one_of_four(hosts, tmp_path, stage, victim):
    """ElasticFSDP with Adam (the replica ring alternates hosts, 0 2 1 3: every rank's replica lives
    on the other host). Training finishes on 3 ranks, the dead rank's shards and Adam state rebuilt from its
    replica; the survivors' parameters are bit-equal to each other and equal the single-process
    reference to rounding (the reduce-scatter folds per host, then across hosts)."""
    out, procs = _start(hosts, tmp_path, "test_elastic_hosts:_fsdp_job", victim, stage)
    runs = _collect(hosts, tmp_path, out, procs, victim)
    params0, ref, recoveries = runs[0]["result"]
    assert f"rank {victim} (pid" in recoveries[0]["excluded"][0], recoveries
    names = [n for n, _ in _fsdp_model().named_parameters()]
    for r, run in runs.items():
        params = run["result"][0]
        for name, q in zip(names, ref):
            assert torch.equal(params[name], params0[name]), f"rank {r}: {name} differs from rank 0"
            torch.testing.assert_close(params[name], q, rtol=1e-5, atol=1e-6)
