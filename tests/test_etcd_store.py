"""The store kept in etcd (torchdist_ext.etcd_store): no single host holds the job's store.

A 3-member etcd cluster on 3 test hosts (tests/_etcd.py, one member per host); 4 ranks: 0 and 1 on
hostA (the host of the etcd leader, moved there on purpose, and of rank 0, whose process would
serve the default TCPStore), 2 on hostB, 3 on hostC, all meeting through TDX_STORE (init_distributed).
Every process of hostA is SIGKILLed, the etcd member with them; the survivors keep using the store:
keys written and read across hosts, an atomic counter, and dist.shrink_group excluding hostA's ranks,
which re-forms the Gloo part between hostB and hostC through the store, then an all_reduce on the
new group against its exact value. Skips with the reason where test hosts or etcd cannot run.
"""
import glob
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from _testhosts import TestHosts
from _testhosts import unavailable_reason as hosts_unavailable
from torchdist_ext.etcd_store import parse_etcd_url

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def test_parse_etcd_url_and_its_errors():
    assert parse_etcd_url("etcd://a:1,b,[::1]:3/job/7") == ([("a", 1), ("b", 2379), ("::1", 3)], "job/7/")
    with pytest.raises(ValueError, match="is not an etcd URL"):
        parse_etcd_url("tcp://a:1/x")
    with pytest.raises(ValueError, match="has no job prefix"):
        parse_etcd_url("etcd://a:1,b:2")
    with pytest.raises(ValueError, match="empty member between commas"):
        parse_etcd_url("etcd://a:1,,b:2/x")
    with pytest.raises(ValueError, match="port that is not a number"):
        parse_etcd_url("etcd://a:x/j")


@pytest.fixture
def cluster():
    """3 test hosts with an etcd member each; the leader on hostA (each test kills hostA)."""
    reason = hosts_unavailable()
    if reason:
        pytest.skip(reason)
    from _etcd import EtcdCluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with TestHosts(3) as hosts, EtcdCluster(hosts) as etcd:
        etcd.move_leader("hostA")
        print(f"etcd: 3 members healthy {etcd.started_seconds:.2f} s after the first started", file=sys.stderr)
        yield hosts, etcd
    left = [p.pid for p in etcd.procs.values() if p.poll() is None]
    assert not left, f"etcd members still running after teardown: {left}"


def _wait_for(path, timeout=120):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.05)


def _store_job(rank, ws, out):
    """The ranks of hostA wait to be killed; the others go on with the store after hostA's loss:
    keys across hosts, an atomic counter, and a shrink that excludes hostA's ranks."""
    from torchdist_ext import elastic

    hosts = [None] * ws
    dist.all_gather_object(hosts, socket.gethostname())
    lost = [r for r in range(ws) if hosts[r] == "hostA"]
    survivors = [r for r in range(ws) if r not in lost]
    open(os.path.join(out, f"ready{rank}"), "w").close()
    if rank in lost:
        time.sleep(600)  # until the test kills hostA
        raise AssertionError("hostA was not killed")
    _wait_for(os.path.join(out, "hostA-killed"))
    store = dist.distributed_c10d._get_default_store()
    started = time.monotonic()
    store.set(f"after/{rank}", hosts[rank])
    seen = {r: store.get(f"after/{r}").decode() for r in survivors}
    count = store.add("after/count", 1)
    new = elastic.shrink_group(lost, shrink_flags=elastic.SHRINK_ABORT)
    x = torch.arange(8, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(x, group=new)
    expected = torch.arange(8, dtype=torch.float32) * sum(r + 1 for r in survivors)
    return {"lost": lost, "seen": seen, "count": count, "new": (new.rank(), new.size()),
            "new_expected": (survivors.index(rank), len(survivors)), "sum_ok": torch.equal(x, expected),
            "seconds": time.monotonic() - started}


def _check_survivors(runs, lost):
    """The results of _store_job on the survivors (hostB and hostC)."""
    assert sorted(run["host"] for run in runs.values()) == ["hostB", "hostC"], runs
    for r, run in runs.items():
        res = run["result"]
        assert res["lost"] == lost, res
        assert res["seen"] == {q: runs[q]["host"] for q in runs}, res
        assert res["new"] == res["new_expected"] and res["sum_ok"], res
    assert sorted(run["result"]["count"] for run in runs.values()) == [1, 2]


def _kill_host_a_once_ready(hosts, etcd, out, tmp_path):
    """Waits until the 4 ranks are ready, SIGKILLs every process of hostA (its ranks and its etcd
    member, the leader: a power cut), tells the survivors; returns a function giving every log."""
    def logs():
        return "\n".join(f"--- {p} ---\n{open(p).read()[-3000:]}"
                         for p in sorted(glob.glob(str(tmp_path / "*.log")))) + etcd.logs()

    try:
        for rank in range(4):
            _wait_for(str(out / f"ready{rank}"), timeout=180)
    except TimeoutError:
        pytest.fail("the ranks did not all start:\n" + logs())
    assert etcd.leader("hostB") == "hostA"
    hosts.kill("hostA")
    assert etcd.alive() == ["hostB", "hostC"]
    (out / "hostA-killed").touch()
    return logs


def start_ranks(hosts, etcd, tmp_path, target, *args, env=None, placement=None):
    """Ranks 0 and 1 on hostA, 2 on hostB, 3 on hostC (or ``placement``: rank -> host index), each
    running tests/_hostjob.py with TDX_STORE in ``etcd``; returns (the results folder, the processes)."""
    out = tmp_path / "out"
    out.mkdir()
    url = etcd.url(f"test-{os.getpid()}-{time.monotonic_ns()}")
    placement = placement or {0: 0, 1: 0, 2: 1, 3: 2}
    local = {}
    for rank, host in placement.items():
        mates = [r for r in placement if placement[r] == host]
        local[rank] = (mates.index(rank), len(mates))
    procs = []
    for rank, host in placement.items():
        rank_env = {"PYTHONPATH": os.pathsep.join([REPO, HERE] + sys.path), "TDX_TEST_PG_TIMEOUT": 120,
                    "OMP_NUM_THREADS": 1, "TDX_STORE": url, "MASTER_ADDR": hosts.hosts[0].name,
                    "MASTER_PORT": 29999, "RANK": rank, "WORLD_SIZE": len(placement), "LOCAL_RANK": local[rank][0],
                    "LOCAL_WORLD_SIZE": local[rank][1], **(env or {})}
        with open(tmp_path / f"rank{rank}.log", "w") as log:
            procs.append(hosts.popen(host, [sys.executable, os.path.join(HERE, "_hostjob.py"), str(out), target,
                                            *map(str, args)], env=rank_env, stdout=log, stderr=subprocess.STDOUT))
    return out, procs


def test_ranks_keep_the_store_when_the_host_of_rank0_and_of_the_etcd_leader_dies(cluster, tmp_path):
    hosts, etcd = cluster
    out, procs = start_ranks(hosts, etcd, tmp_path, "test_etcd_store:_store_job", tmp_path / "out")
    logs = _kill_host_a_once_ready(hosts, etcd, out, tmp_path)
    hosts.wait(procs[2:], timeout=180)
    errors = [open(p).read() for p in sorted(glob.glob(str(out / "rank*.err")))]
    if errors or not all((out / f"rank{r}.pt").exists() for r in (2, 3)):
        pytest.fail("\n".join(errors) + logs())
    assert etcd.leader("hostB", members=etcd.members[1:]) in ("hostB", "hostC")
    runs = {r: torch.load(out / f"rank{r}.pt", weights_only=False) for r in (2, 3)}
    _check_survivors(runs, [0, 1])
    print(f"after hostA's loss: store calls and the shrink took "
          f"{max(run['result']['seconds'] for run in runs.values()):.2f} s", file=sys.stderr)


def test_torchrun_agents_and_ranks_go_on_when_the_host_that_started_the_rendezvous_dies(cluster, tmp_path):
    """The same job under python -m torchdist_ext.run --rdzv-backend=etcd-v3 on the 3 hosts (2
    workers on hostA, the first to start, 1 on hostB and hostC): after hostA's loss the agents of
    hostB and hostC keep their workers (with the c10d rendezvous they fail with
    RendezvousConnectionError: its store lived on hostA), the workers finish through TDX_STORE,
    and both agents exit 0."""
    hosts, etcd = cluster
    out = tmp_path / "out"
    out.mkdir()
    endpoint = ",".join(f"{h.ip}:2379" for h in etcd.members)
    run_id = f"tdx{os.getpid()}x{time.monotonic_ns()}"
    env = {"PYTHONPATH": os.pathsep.join([REPO, HERE] + sys.path), "TDX_TEST_PG_TIMEOUT": 120,
           "OMP_NUM_THREADS": 1}
    procs = []
    for h, nproc in zip(hosts.hosts, (2, 1, 1)):
        argv = [sys.executable, "-m", "torchdist_ext.run", "--keep-survivors", "--exit-barrier-timeout", "5",
                "--nnodes=3", f"--nproc-per-node={nproc}", "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={endpoint}",
                f"--rdzv-id={run_id}", "--max-restarts=0", "--log-dir", str(tmp_path / f"logs-{h.name}"),
                os.path.join(HERE, "_hostjob.py"), str(out), "test_etcd_store:_store_job", str(out)]
        with open(tmp_path / f"{h.name}.log", "w") as log:
            procs.append(hosts.popen(h.index, argv, env=env, stdout=log, stderr=subprocess.STDOUT))
        if h.index == 0:
            time.sleep(1.0)  # hostA's agent starts the rendezvous
    logs = _kill_host_a_once_ready(hosts, etcd, out, tmp_path)
    codes = hosts.wait(procs[1:], timeout=180)
    errors = [open(p).read() for p in sorted(glob.glob(str(out / "rank*.err")))]
    results = sorted(glob.glob(str(out / "rank*.pt")))
    if errors or len(results) != 2 or codes != [0, 0]:
        pytest.fail(f"agents of hostB, hostC exited {codes}\n" + "\n".join(errors) + logs())
    runs = {int(os.path.basename(p)[4:-3]): torch.load(p, weights_only=False) for p in results}
    lost = next(iter(runs.values()))["result"]["lost"]
    assert len(lost) == 2 and sorted(lost + sorted(runs)) == [0, 1, 2, 3], (lost, sorted(runs))
    _check_survivors(runs, lost)
    for h in ("hostB", "hostC"):
        assert "RendezvousConnectionError" not in open(tmp_path / f"{h}.log").read()
