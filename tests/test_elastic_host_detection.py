"""How fast the survivors learn of a lost host, and that they then go on (TDX_STORE in etcd).

3 test hosts with an etcd member each (tests/_etcd.py). The ranks of hostA stop before step
KILL_STEP of epoch 0 and wait there; the others go on into that step and block in it, waiting for
them. Then the test:

- SIGKILLs every process of hostA (its etcd member, the leader, too): its ranks' liveness
  connections close, a survivor that reads one revokes that rank's lease, and every survivor's
  watch of ``tdx/alive/`` interrupts its group (``TdxBackend.interrupt``), also the ranks whose
  wait does not touch hostA (a pipeline's stage waiting for a live neighbour);
- or cuts hostA's link for good (``TestHosts.set_link``): nothing closes, the survivors learn it
  when hostA's leases expire (TDX_FAILURE_DETECTION_S).

The group timeout (600 s) exceeds the test's deadline, so a survivor that learnt of the loss only
at the timeout fails the test, and each recovery must name how the loss was told (the closed
liveness connection after a kill, the expired lease after a cut). The survivors' result equals a reference that drops hostA's ranks
from that step on (DDP: to rounding, the reduction folds per host first; the pipeline: bit for bit,
one process training the unsplit model). Each test prints the time from the kill (or cut) to each
survivor's next completed step.
"""
import glob
import os
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from _elastic_runs import EPOCHS, KILL_EPOCH, KILL_STEP, batches, dataset
from test_elastic_ddp import LR, _loss, _model, _reference
from test_etcd_store import cluster, start_ranks  # noqa: F401  (cluster: the fixture)

DETECTION_S = 5


def _hold_at_the_kill_step(rank, out, lost):
    """hostA's ranks: say they are there, then wait for the test to kill or cut off their host."""
    if rank in lost:
        open(os.path.join(out, f"ready{rank}"), "w").close()
        time.sleep(600)
        raise AssertionError("hostA was not killed or cut off")


def _ddp_job(rank, ws, out, lost):
    from torchdist_ext.elastic import ElasticDDP

    lost = [int(r) for r in lost.split(",")]
    ds, model = dataset(), _model()
    sampler = DistributedSampler(ds, num_replicas=ws, rank=rank, shuffle=True, seed=0)
    trainer = ElasticDDP(model, torch.optim.SGD(model.parameters(), lr=LR), sampler=sampler)
    done = []  # (epoch, step, wall time) of each completed step
    for epoch in range(EPOCHS):
        for step, (x, y) in enumerate(batches(ds, sampler, epoch)):
            if (epoch, step) == (KILL_EPOCH, KILL_STEP):
                _hold_at_the_kill_step(rank, out, lost)
            trainer.step(lambda m: _loss(m, x, y))
            done.append((epoch, step, time.time()))
    ref = _reference({r: KILL_STEP for r in lost}) if rank == ws - 1 else None
    return [p.detach().clone() for p in model.parameters()], ref, trainer.recoveries, done


def _stuck_job(rank, ws, out, stuck):
    """ElasticDDP; rank ``stuck`` (alone on its host) SIGSTOPs itself before step KILL_STEP of epoch
    0, so its lease goes unrefreshed; rank 0 sends it SIGCONT after its recovery. The resumed rank
    must raise RankExcludedError; the survivors keep their new group until it has."""
    from torchdist_ext.elastic import ElasticDDP, RankExcludedError

    stuck, tried = int(stuck), os.path.join(out, "tried")
    ds, model = dataset(), _model()
    sampler = DistributedSampler(ds, num_replicas=ws, rank=rank, shuffle=True, seed=0)
    trainer = ElasticDDP(model, torch.optim.SGD(model.parameters(), lr=LR), sampler=sampler)
    done, continued = [], False
    try:
        for epoch in range(EPOCHS):
            for step, (x, y) in enumerate(batches(ds, sampler, epoch)):
                if rank == stuck and (epoch, step) == (KILL_EPOCH, KILL_STEP):
                    with open(os.path.join(out, f"pid{rank}"), "w") as f:
                        f.write(str(os.getpid()))
                    os.kill(os.getpid(), signal.SIGSTOP)
                trainer.step(lambda m: _loss(m, x, y))
                done.append((epoch, step, time.time()))
                if rank == 0 and trainer.recoveries and not continued:
                    with open(os.path.join(out, f"pid{stuck}")) as f:
                        os.kill(int(f.read()), signal.SIGCONT)  # it runs again while the others train on
                    continued = True
    except RankExcludedError as error:
        if rank != stuck:
            raise
        open(tried, "w").close()
        return "excluded", str(error)
    assert rank != stuck, "the stopped rank was never excluded"
    deadline = time.monotonic() + 120
    while not os.path.exists(tried) and time.monotonic() < deadline:
        time.sleep(0.05)
    ref = _reference({stuck: KILL_STEP}) if rank == 0 else None
    return [p.detach().clone() for p in model.parameters()], ref, trainer.recoveries, done


def _fsdp_job(rank, ws, out, lost):
    """ElasticFSDP stage 3 with Adam (tests/test_elastic_fsdp.py's model); the replica ring is
    0 2 1 3 (hosts A A B C), so hostA's shards have their replicas on hostB and hostC."""
    from torchdist_ext import ModuleWrapPolicy
    from torchdist_ext.elastic import ElasticFSDP
    from test_elastic_fsdp import Block, _full_params, _optimizer_fn
    from test_elastic_fsdp import _loss as fsdp_loss, _model as fsdp_model, _reference as fsdp_reference

    lost = [int(r) for r in lost.split(",")]
    ds, model = dataset(), fsdp_model()
    names = [n for n, _ in model.named_parameters()]
    sampler = DistributedSampler(ds, num_replicas=ws, rank=rank, shuffle=True, seed=0)
    trainer = ElasticFSDP(model, _optimizer_fn(), sampler=sampler, stage=3, auto_wrap_policy=ModuleWrapPolicy({Block}))
    done = []
    for epoch in range(EPOCHS):
        for step, (x, y) in enumerate(batches(ds, sampler, epoch)):
            if (epoch, step) == (KILL_EPOCH, KILL_STEP):
                _hold_at_the_kill_step(rank, out, lost)
            trainer.step(fsdp_loss, x, y)
            done.append((epoch, step, time.time()))
    params = _full_params(trainer)
    ref = fsdp_reference({r: KILL_STEP for r in lost}) if rank == ws - 1 else None
    return [params[n] for n in names], ref, trainer.recoveries, done


def _pipeline_job(rank, ws, out, lost):
    from test_elastic_pipeline import KILL_STEP as PIPE_KILL, STEPS, _batch, _own_params, _reference as pipe_ref
    from test_elastic_pipeline import _trainer

    lost = [int(r) for r in lost.split(",")]
    trainer = _trainer("1f1b")
    done = []
    for step in range(STEPS):
        if step == PIPE_KILL:
            _hold_at_the_kill_step(rank, out, lost)
        x, y = _batch(step)
        trainer.step(x, target=y)
        done.append((0, step, time.time()))
    ref = pipe_ref() if rank == ws - 1 else None
    return _own_params(trainer), ref, trainer.recoveries, done


def _run(hosts, etcd, tmp_path, job, lost, placement, fault):
    """Starts ``job`` on ``placement`` (rank -> host index), waits for hostA's ranks at the kill
    step, applies ``fault`` ("kill" or "cut") to hostA; returns the survivors' results and the
    time of the fault."""
    out, procs = start_ranks(hosts, etcd, tmp_path, f"test_elastic_host_detection:{job}", tmp_path / "out",
                             ",".join(map(str, lost)), placement=placement,
                             env={"TDX_FAILURE_DETECTION_S": DETECTION_S, "TDX_TEST_PG_TIMEOUT": 600, "PYTHONFAULTHANDLER": 1})

    def logs():
        return "\n".join(f"--- {p} ---\n{open(p).read()[-3000:]}"
                         for p in sorted(glob.glob(str(tmp_path / "*.log")))) + etcd.logs()

    deadline = time.monotonic() + 180
    while not all((out / f"ready{r}").exists() for r in lost):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            pytest.fail("hostA's ranks did not reach the kill step:\n" + logs())
        time.sleep(0.05)
    time.sleep(0.5)  # the survivors enter the step and wait in it
    fault_at = time.time()
    if fault == "kill":
        hosts.kill("hostA")
    else:
        hosts.set_link("hostA", False)
    survivors = [r for r in placement if r not in lost]
    codes = hosts.wait([procs[r] for r in survivors], timeout=120)
    if fault == "cut":
        hosts.kill("hostA")
    errors = [open(p).read() for p in sorted(glob.glob(str(out / "rank*.err")))]
    if errors or codes != [0] * len(survivors):
        pytest.fail(f"survivors exited {codes}\n" + "\n".join(errors) + logs())
    return {r: torch.load(out / f"rank{r}.pt", weights_only=False)["result"] for r in survivors}, fault_at


def _after_fault(runs, fault_at):
    """Seconds from the fault to each survivor's next completed step."""
    return {r: min(t for _, _, t in run[3] if t > fault_at) - fault_at for r, run in runs.items()}


KILLED = ("liveness connection closed", "refused a connection to its liveness port")  # how a kill is told
EXPIRED = ("liveness lease in etcd expired",)  # how a cut is told


def _check_ddp(runs, lost, why):
    (params, ref, recoveries, _), *others = runs.values()
    ref = next(run[1] for run in runs.values() if run[1] is not None)
    for run in others:
        assert all(torch.equal(p, q) for p, q in zip(params, run[0])), "the survivors differ"
    for p, q in zip(params, ref):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert [r["step"] for r in recoveries] == [KILL_STEP] and recoveries[0]["world_size"] == 4 - len(lost), recoveries
    excluded = recoveries[0]["excluded"]
    if why is KILLED:
        # The first lost rank is told by the positive sign; a host mate of it may be told by its key's
        # deletion, which a peer's revoke of its lease caused (reported as the key gone), under load.
        assert any(w in e for e in excluded for w in KILLED), recoveries
        assert all(any(w in e for w in KILLED + EXPIRED) for e in excluded), recoveries
    else:
        assert all(any(w in e for w in why) for e in excluded), recoveries


@pytest.mark.parametrize("fault", ["kill", "cut"], ids=["SIGKILL", "link-cut-for-good"])
def test_elastic_ddp_survives_losing_a_whole_host_at_the_detection_time(cluster, tmp_path, fault):  # noqa: F811
    """4 ranks (2 on hostA, 1 on hostB and hostC)."""
    hosts, etcd = cluster
    runs, fault_at = _run(hosts, etcd, tmp_path, "_ddp_job", [0, 1], {0: 0, 1: 0, 2: 1, 3: 2}, fault)
    _check_ddp(runs, [0, 1], KILLED if fault == "kill" else EXPIRED)
    after = _after_fault(runs, fault_at)
    recovery = ", ".join(f"{run[2][0]['seconds']:.2f}" for run in runs.values())
    print(f"{fault}: fault -> next completed step {', '.join(f'{s:.2f}' for s in after.values())} s; recovery "
          f"{recovery} s", file=sys.stderr)


def test_elastic_fsdp_stage3_survives_a_whole_host_cut_off_for_good(cluster, tmp_path):  # noqa: F811
    """4 ranks (2 on hostA, 1 on hostB and hostC), ElasticFSDP stage 3 with Adam; hostA's link is cut
    for good: the survivors learn it when hostA's leases expire, rebuild hostA's shards and Adam
    state from the replicas on hostB and hostC and finish on 2 ranks, equal to the reference that
    drops ranks 0 and 1 at the same step to rounding (across hosts the reduce-scatter folds per
    host first)."""
    hosts, etcd = cluster
    runs, fault_at = _run(hosts, etcd, tmp_path, "_fsdp_job", [0, 1], {0: 0, 1: 0, 2: 1, 3: 2}, "cut")
    _check_ddp(runs, [0, 1], EXPIRED)
    after = _after_fault(runs, fault_at)
    print(f"fsdp cut: fault -> next completed step {', '.join(f'{s:.2f}' for s in after.values())} s",
          file=sys.stderr)


def test_elastic_ddp_two_hosts_of_two_ranks_with_an_etcd_only_third_host(cluster, tmp_path):  # noqa: F811
    """hostA and hostB run 2 ranks each; hostC runs only its etcd member (3 members: a majority
    survives hostA). hostA is SIGKILLed: hostB's ranks go on as a one-host group."""
    hosts, etcd = cluster
    runs, fault_at = _run(hosts, etcd, tmp_path, "_ddp_job", [0, 1], {0: 0, 1: 0, 2: 1, 3: 1}, "kill")
    _check_ddp(runs, [0, 1], KILLED)
    after = _after_fault(runs, fault_at)
    recovery = ", ".join(f"{run[2][0]['seconds']:.2f}" for run in runs.values())
    print(f"2x2: fault -> next completed step {', '.join(f'{s:.2f}' for s in after.values())} s; recovery "
          f"{recovery} s", file=sys.stderr)


@pytest.mark.parametrize("fault", ["kill", "cut"], ids=["SIGKILL", "link-cut-for-good"])
def test_elastic_pipeline_survives_losing_a_whole_host_bit_for_bit(cluster, tmp_path, fault):  # noqa: F811
    """ElasticPipeline (1F1B, Adam, 7 layers) on 4 ranks, stages 0 and 1 on hostA (their replicas
    on hostB and hostC, the replica ring alternating hosts); hostA is SIGKILLed in step 3 (or its
    link cut for good: told when its leases expire): stage 3 waits for stage 2, alive, and learns
    of the loss from the interrupt. The survivors' two stages together equal one process training
    the unsplit model, bit for bit."""
    hosts, etcd = cluster
    runs, fault_at = _run(hosts, etcd, tmp_path, "_pipeline_job", [0, 1], {0: 0, 1: 0, 2: 1, 3: 2}, fault)
    ref = next(run[1] for run in runs.values() if run[1] is not None)
    merged = {}
    for run in runs.values():
        for name, value in run[0].items():
            assert name not in merged, f"{name} is on two stages"
            merged[name] = value
    assert sorted(merged) == sorted(ref)
    for name, want in ref.items():
        assert torch.equal(merged[name], want), f"{name} differs from the reference"
    for run in runs.values():
        assert [r["step"] for r in run[2]] == [3] and run[2][0]["world_size"] == 2, run[2]
        excluded = run[2][0]["excluded"]
        assert all(any(w in e for w in (KILLED if fault == "kill" else EXPIRED)) for e in excluded), run[2]
    after = _after_fault(runs, fault_at)
    print(f"pipeline {fault}: fault -> next completed step {', '.join(f'{s:.2f}' for s in after.values())} s",
          file=sys.stderr)


def test_a_rank_stopped_alone_on_its_host_is_excluded_and_once_resumed_exits_excluded(cluster, tmp_path):  # noqa: F811
    """4 ranks (2 on hostA, 1 on hostB and hostC); rank 3, alone on hostC, is SIGSTOPped before step
    3: no host mate sees its progress mark, but its lease goes unrefreshed, so the others exclude it
    after TDX_FAILURE_DETECTION_S and finish on 3 ranks (equal to the reference that drops rank 3 at
    that step, to rounding). Resumed, rank 3 raises RankExcludedError: its own liveness key is gone."""
    hosts, etcd = cluster
    out, procs = start_ranks(hosts, etcd, tmp_path, "test_elastic_host_detection:_stuck_job", tmp_path / "out", 3,
                             env={"TDX_FAILURE_DETECTION_S": DETECTION_S, "TDX_TEST_PG_TIMEOUT": 600,
                                  "PYTHONFAULTHANDLER": 1})
    codes = hosts.wait(procs, timeout=240)
    errors = [open(p).read() for p in sorted(glob.glob(str(out / "rank*.err")))]
    if errors or codes != [0] * 4:
        logs = "\n".join(f"--- {p} ---\n{open(p).read()[-3000:]}" for p in sorted(glob.glob(str(tmp_path / "*.log"))))
        pytest.fail(f"ranks exited {codes}\n" + "\n".join(errors) + logs + etcd.logs())
    results = {r: torch.load(out / f"rank{r}.pt", weights_only=False)["result"] for r in range(4)}
    status, msg = results.pop(3)
    assert status == "excluded" and "this rank was excluded from the group" in msg and "must exit" in msg, msg
    _check_ddp(results, [3], EXPIRED)
