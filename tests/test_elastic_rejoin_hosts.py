"""A whole host comes back: ElasticDDP, ElasticFSDP stage 3 and ElasticPipeline (rejoin=True) on 2
test hosts x 2 ranks, the store in etcd (a member on each of 3 test hosts, tests/_etcd.py). Every
process of hostA (ranks 0 and 1, the etcd leader) is SIGKILLed; hostB's ranks learn it from the
liveness leases and go on as 2. Then hostA's ranks are started again with the same command
(tests/_hostjob.py, the same environment): ``init_distributed`` finds the job running in the store
and joins it (``elastic.rejoin``); the members admit them at a step boundary, the group is re-formed
at 4 across the two hosts, and the parameters, optimizer state and position come from hostB over
the network. Training ends on 4 ranks whose parameters are bit-equal to each other (DDP, FSDP); the
pipeline's 4 stages, re-placed over both hosts, together equal bit for bit one process training the
unsplit model, and every stage's replica equals it on the other host. Reports the time from a
joiner's process start to its first completed step, and the steps redone. Skips with the reason
where test hosts or etcd cannot run.
"""
import glob
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from _elastic_runs import batches, dataset
from test_elastic_rejoin import _loss, _params, _trainer
from test_etcd_store import HERE, REPO, cluster  # noqa: F401  (cluster: the fixture)

AFTER = 20  # steps the job trains at full width again before it ends
STEP_S = 0.05  # a slower step, so that the restart finds the job still training


def _marker(name):
    with open(os.path.join(os.environ["TEST_OUT"], name), "w") as f:
        f.write(str(time.time()))


def _full_again(trainer):
    """Whether the job trained AFTER steps at full width again (the same on every rank)."""
    return trainer.world_size == 4 and trainer.generation >= 1 and trainer.steps_done >= trainer.generation_began + AFTER


def _inputs(kind, trainer, ds, sampler, record):
    """(args, kwargs) of each ``trainer.step``: DDP and FSDP the rank's batches from the joiner's place
    in the data on; the pipeline the whole batch of the step about to be done (every rank the same)."""
    if kind == "pipeline":
        from test_elastic_pipeline import _batch

        while True:
            x, y = _batch(trainer.steps_done)
            yield (x,), {"target": y}
    epoch, skip = (record["epoch"], record["step"]) if record else (0, 0)
    while True:
        for step, (x, y) in enumerate(batches(ds, sampler, epoch)):
            if step >= skip:
                yield (_loss, x, y), {}
        epoch, skip = epoch + 1, 0


def _pipeline_state(trainer):
    """This rank's stage (named values), its values and Adam state, its replica, and the ring."""
    own = list(trainer.parts[trainer.rank].parameters())
    return {"stage": {n: p.detach().clone() for n, p in trainer.parts[trainer.rank].named_parameters()},
            "own": ([p.detach().clone() for p in own],
                    [{k: v.clone() for k, v in trainer.optimizer.state[p].items()} for p in own]),
            "replica": trainer.replica.snapshot(), "rank": trainer.rank, "ring": trainer.ring.order}


def _job(env_rank, ws, kind, save=""):
    from torchdist_ext.elastic._rejoin import joined

    record = joined()
    job_began = time.time()
    ds = dataset()
    if kind == "pipeline":
        from test_elastic_rejoin import _pipeline_trainer

        trainer, sampler = _pipeline_trainer(), None
    else:
        trainer, sampler = _trainer(kind, ds, dist.get_world_size(), dist.get_rank())
    built = time.time()
    first_step = None
    inputs = _inputs(kind, trainer, ds, sampler, record)
    while not _full_again(trainer) and trainer.steps_done < 3000:
        args, kwargs = next(inputs)
        time.sleep(STEP_S)
        trainer.step(*args, **kwargs)
        first_step = first_step or time.time()
        if record is None:
            if trainer.steps_done == 5:
                _marker("warm")
            if trainer.recoveries and not os.path.exists(os.path.join(os.environ["TEST_OUT"], "recovered")):
                _marker("recovered")
    launched = float(os.environ.get("TEST_LAUNCHED_AT", "nan"))
    result = {"params": _pipeline_state(trainer) if kind == "pipeline" else _params(trainer),
              "world_size": trainer.world_size,
              "steps_done": trainer.steps_done, "recoveries": trainer.recoveries, "rejoins": trainer.rejoins,
              "joined": record, "start_to_first_step": first_step - launched if record else None,
              "phases": {"import": record["times"]["announce"] - launched, "wait": record["times"]["admitted"] - record["times"]["announce"],
                         "group": record["times"]["group"] - record["times"]["admitted"], "state": built - job_began,
                         "step": first_step - built} if record else None}
    if save:  # under torchdist_ext.run the RANK variables of members and joiners overlap: one file per process
        torch.save(result, os.path.join(os.environ["TEST_OUT"], f"{save}-{os.getpid()}.pt"))
    return result


def _start(hosts, url, out, tmp_path, rank, host, kind, extra=None, tag=""):
    env = {"PYTHONPATH": os.pathsep.join([REPO, HERE] + sys.path), "TDX_TEST_PG_TIMEOUT": 600,
           "OMP_NUM_THREADS": 1, "TDX_STORE": url, "MASTER_ADDR": "hostA", "MASTER_PORT": 29999,
           "RANK": rank, "WORLD_SIZE": 4, "LOCAL_RANK": rank % 2, "LOCAL_WORLD_SIZE": 2,
           "TDX_FAILURE_DETECTION_S": 5, "TEST_OUT": str(out), **(extra or {})}
    with open(tmp_path / f"rank{rank}{tag}.log", "w") as log:
        return hosts.popen(host, [sys.executable, os.path.join(HERE, "_hostjob.py"), str(out),
                                  "test_elastic_rejoin_hosts:_job", kind], env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait_file(path, procs, timeout=240):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            return False
        time.sleep(0.05)
    return True


def _check_pipeline(runs, hosts):
    """The 4 stages at the end (env rank -> ``_pipeline_state``, host): each replica equals its ring
    source's stage and Adam state and lives on the other host, and the stages together equal bit for
    bit one process training the unsplit model for the same steps."""
    from _elastic_runs import assert_replica_equals
    from test_elastic_pipeline import _reference
    from torchdist_ext.elastic._placement import Ring

    steps = {run["steps_done"] for run in runs.values()}
    assert len(steps) == 1, steps
    by_rank = {run["params"]["rank"]: (run["params"], hosts[r]) for r, run in runs.items()}
    assert sorted(by_rank) == [0, 1, 2, 3], sorted(by_rank)
    ring = Ring(by_rank[0][0]["ring"])
    for g, (state, host) in by_rank.items():
        assert state["ring"] == ring.order, (g, state["ring"], ring.order)
        source, source_host = by_rank[ring.source(g)]
        assert host != source_host, f"rank {g} on {host} holds the replica of rank {ring.source(g)}, on the same host"
        assert_replica_equals(state["replica"], source["own"], f"rank {g}'s replica of stage {ring.source(g)}")
    merged = {}
    for state, _ in by_rank.values():
        for name, value in state["stage"].items():
            assert name not in merged, f"{name} is on two stages"
            merged[name] = value
    ref = _reference(steps.pop())
    assert sorted(merged) == sorted(ref), (sorted(merged), sorted(ref))
    for name, want in ref.items():
        assert torch.equal(merged[name], want), f"{name} differs from the reference"


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "pipeline"], ids=["ElasticDDP", "ElasticFSDP-stage3", "ElasticPipeline"])
def test_a_whole_host_killed_and_started_again_rejoins(cluster, tmp_path, kind):  # noqa: F811
    hosts, etcd = cluster
    out = tmp_path / "out"
    out.mkdir()
    url = etcd.url(f"rejoin-{os.getpid()}-{time.monotonic_ns()}")
    procs = {r: _start(hosts, url, out, tmp_path, r, "hostA" if r < 2 else "hostB", kind) for r in range(4)}

    def logs():
        return "\n".join(f"--- {p} ---\n{open(p).read()[-3000:]}" for p in sorted(glob.glob(str(tmp_path / "*.log"))))

    if not _wait_file(out / "warm", list(procs.values())):
        pytest.fail("the job did not reach step 5\n" + logs() + etcd.logs())
    hosts.kill("hostA")  # ranks 0 and 1, the etcd leader: everything on hostA
    if not _wait_file(out / "recovered", [procs[2], procs[3]]):
        pytest.fail("hostB's ranks did not recover\n" + logs() + etcd.logs())
    launched = time.time()
    for r in (0, 1):  # the same command again on hostA
        procs[r] = _start(hosts, url, out, tmp_path, r, "hostA", kind, {"TEST_LAUNCHED_AT": launched}, tag="-restarted")
    codes = hosts.wait([procs[r] for r in range(4)], timeout=300)
    errors = [open(p).read() for p in sorted(glob.glob(str(out / "rank*.err")))]
    if errors or codes != [0, 0, 0, 0]:
        pytest.fail(f"ranks exited {codes}\n" + "\n".join(errors) + logs())
    saved = {r: torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)}
    runs = {r: s["result"] for r, s in saved.items()}
    for r, run in runs.items():
        assert run["world_size"] == 4, (r, run["world_size"])
    if kind == "pipeline":  # the joiners (env ranks 0 and 1) come after the members: the last two stages
        assert sorted(runs[r]["params"]["rank"] for r in (0, 1)) == [2, 3], [runs[r]["params"]["rank"] for r in range(4)]
        _check_pipeline(runs, {r: s["host"] for r, s in saved.items()})
    else:
        first = runs[2]["params"]
        for r, run in runs.items():
            assert all(torch.equal(p, q) for p, q in zip(run["params"], first)), f"rank {r} (env) differs from rank 2"
    assert runs[0]["joined"] and runs[1]["joined"] and not runs[2]["joined"]
    assert len(runs[2]["recoveries"]) == 1 and 1 <= len(runs[2]["rejoins"]) <= 2, runs[2]
    print(f"{kind}: joiners: process start to first completed step {runs[0]['start_to_first_step']:.2f} s, "
          f"{runs[1]['start_to_first_step']:.2f} s; admitted at step(s) {[j['step'] for j in runs[2]['rejoins']]} "
          f"in {[round(j['seconds'], 3) for j in runs[2]['rejoins']]} s; recovery {runs[2]['recoveries'][0]['seconds']:.2f} s "
          f"(steps redone: {len(runs[2]['recoveries'])}, the failed one); joiner phases (s): "
          f"{[{k: round(v, 2) for k, v in runs[r]['phases'].items()} for r in (0, 1)]}; members' admissions "
          f"(reform, state): {[(round(j['reform_seconds'], 2), round(j['state_seconds'], 2)) for j in runs[2]['rejoins']]}",
          file=sys.stderr)


def test_the_same_torchdist_ext_run_command_on_a_restarted_host_rejoins(cluster, tmp_path):  # noqa: F811
    """The user's launch: `python -m torchdist_ext.run --keep-survivors --rdzv-backend=etcd-v3 ...` on
    hostA and hostB (2 workers each); everything on hostA SIGKILLed (its agent, its workers, the
    etcd leader), hostB's agent keeps its workers; the same command run again on hostA finds the
    job running in the workers' store and starts its 2 workers as joiners (no rendezvous). Both
    commands exit 0 and the 4 final workers are bit-equal at world size 4."""
    hosts, etcd = cluster
    out = tmp_path / "out"
    out.mkdir()
    endpoint = ",".join(f"{h.ip}:2379" for h in etcd.members)
    run_id = f"tdx{os.getpid()}x{time.monotonic_ns()}"
    env = {"PYTHONPATH": os.pathsep.join([REPO, HERE] + sys.path), "TDX_TEST_PG_TIMEOUT": 600, "OMP_NUM_THREADS": 1,
           "TDX_FAILURE_DETECTION_S": 5, "TEST_OUT": str(out)}

    def agent(host, tag, extra=None):
        argv = [sys.executable, "-m", "torchdist_ext.run", "--keep-survivors", "--exit-barrier-timeout", "5",
                "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={endpoint}",
                f"--rdzv-id={run_id}", "--max-restarts=0", "--log-dir", str(tmp_path / f"logs-{host}{tag}"),
                os.path.join(HERE, "_hostjob.py"), str(out), "test_elastic_rejoin_hosts:_job", "ddp", "final"]
        with open(tmp_path / f"{host}{tag}.log", "w") as log:
            return hosts.popen(host, argv, env={**env, **(extra or {})}, stdout=log, stderr=subprocess.STDOUT)

    def logs():
        return "\n".join(f"--- {p} ---\n{open(p).read()[-4000:]}" for p in sorted(glob.glob(str(tmp_path / "*.log"))))

    first = agent("hostA", "")
    time.sleep(1.0)  # hostA's agent starts the rendezvous
    second = agent("hostB", "")
    if not _wait_file(out / "warm", [first, second]):
        pytest.fail("the job did not reach step 5\n" + logs())
    hosts.kill("hostA")
    if not _wait_file(out / "recovered", [second]):
        pytest.fail("hostB's workers did not recover\n" + logs())
    for p in glob.glob(str(out / "final-*.pt")):
        os.remove(p)  # nothing of the killed workers counts (they wrote none; to be sure)
    again = agent("hostA", "-again", {"TEST_LAUNCHED_AT": time.time()})
    codes = hosts.wait([second, again], timeout=300)
    if codes != [0, 0]:
        pytest.fail(f"the commands on hostB and (again) on hostA exited {codes}\n" + logs())
    runs = [torch.load(p, weights_only=False) for p in sorted(glob.glob(str(out / "final-*.pt")))]
    assert len(runs) == 4, (len(runs), logs())
    assert sum(1 for r in runs if r["joined"]) == 2
    for r in runs:
        assert r["world_size"] == 4 and all(torch.equal(p, q) for p, q in zip(r["params"], runs[0]["params"]))
    assert "join it (--keep-survivors)" in open(tmp_path / "hostA-again.log").read()
    print(f"torchdist_ext.run: joiners' process start to first step "
          f"{[round(r['start_to_first_step'], 2) for r in runs if r['joined']]} s", file=sys.stderr)
