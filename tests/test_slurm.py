"""launch/slurm.sbatch, torchx's SLURM scheduler and preemption on a real SLURM cluster.

The cluster (tests/_slurm_cluster.py): slurmctld, slurmdbd on MariaDB and munge on hostA, one slurmd
on each of hostB and hostC (test hosts: own network, hostname and /dev/shm), Debian's SLURM 22.05,
installed with apt-get when missing. Every job trains examples/train_ddp.py on 2 nodes x 2 ranks and
is judged by what it trained (accuracy, or bitwise the model of an uninterrupted run), not only by
its exit status: both template modes, torchx's SLURM scheduler, scancel, requeue by scontrol and by
the job itself before its time limit, a compute node lost mid-job (fails, is requeued, and resumes
once the node is back), and the same loss survived in place (``sbatch --no-kill``, KEEP_SURVIVORS=1,
the rendezvous and store in etcd on the test hosts: tests/_etcd.py) with the node, back in service,
rejoining the running job (JOIN_JOB), and the batch host's loss (the others finish, the job is
cancelled).
"""
import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from _slurm_cluster import SlurmCluster, unavailable_reason

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "train_ddp.py")
SBATCH = os.path.join(REPO, "launch", "slurm.sbatch")
SHORT = ["--epochs", "6"]  # ~97% test accuracy, the same as on one host
LONG = ["--epochs", "250"]  # ~80 s of training: still running when the time-limit warning comes
JOB_TIMEOUT = 600
# Long enough that the survivors still train when the lost node is back in service (SlurmdTimeout,
# 30 s, then slurmd's start and the joiners' Python start).
REJOIN_EPOCHS = 150


@pytest.fixture(scope="module")
def cluster():
    reason = unavailable_reason(install=True)
    if reason:
        pytest.skip(reason)
    c = SlurmCluster(nodes=2, accounting=True)
    print(f"\nSLURM cluster (slurmdbd + slurmctld + 2 slurmd) started in {c.start_seconds:.1f} s")
    holders = [h.pid for h in c.hosts.hosts]
    try:
        yield c
    finally:
        c.close()
    left = [pid for pid in holders if os.path.exists(f"/proc/{pid}")]
    assert not left, f"namespace holders still running after close(): {left}"


def _env():
    return {"PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p),
            "OMP_NUM_THREADS": "1"}


def _submit(cluster, tmp_path, *sbatch_args, script_args=(), launch="torchrun", ckpt=None):
    args = ["--export=ALL,NPROC=2" + (f",LAUNCH={launch}" if launch != "torchrun" else ""),
            f"--output={tmp_path}/job-%j.out", *sbatch_args, SBATCH, EXAMPLE, *script_args]
    if ckpt:
        args += ["--checkpoint", str(ckpt)]
    return cluster.sbatch(args, cwd=str(tmp_path), env=_env())


def _output(tmp_path, job):
    path = tmp_path / f"job-{job}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def _accuracy(text):
    m = re.search(r"final test accuracy ([\d.]+)%", text)
    assert m, text[-3000:]
    return float(m.group(1))


def _wait_output(tmp_path, job, pattern, cluster, timeout=JOB_TIMEOUT):
    deadline = time.monotonic() + timeout
    while not re.search(pattern, _output(tmp_path, job)):
        state = cluster.job(job).get("JobState")
        if state not in ("PENDING", "RUNNING", "CONFIGURING"):
            raise AssertionError(f"job {job} is {state} before printing {pattern!r}:\n{_output(tmp_path, job)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job}: no {pattern!r} after {timeout} s:\n{_output(tmp_path, job)}")
        time.sleep(0.5)


def _same_model(a, b):
    import torch

    sa, sb = torch.load(a, map_location="cpu"), torch.load(b, map_location="cpu")
    assert sa["step"] == sb["step"], (sa["step"], sb["step"])
    diff = [k for k in sa["model"] if not torch.equal(sa["model"][k], sb["model"][k])]
    assert not diff, f"tensors differ from the uninterrupted run: {diff}"


def _no_job_process_left(cluster):
    """No process of a job (slurmstepd or what it started) on any compute node, and no tdx segment."""
    for n in cluster.nodes:
        # Zombies (empty command line) are slurmd's to reap; slurmd itself stays.
        left = [(pid, cmd) for pid, cmd in cluster.processes(n) if cmd and not cmd.startswith("slurmd")]
        assert not left, f"{n}: job processes left: {left}"
        shm = cluster.hosts.shm_files(n)
        assert not [f for f in shm if f.startswith("tdx")], f"{n}: /dev/shm holds {shm}"


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    """The uninterrupted LONG run (srun torchrun, 2 x 2): its output and final checkpoint."""
    d = tmp_path_factory.mktemp("reference")
    job = _submit(cluster, d, script_args=LONG, ckpt=d / "ref.pt")
    assert cluster.wait_job(job, JOB_TIMEOUT) == "COMPLETED", _output(d, job)
    return _output(d, job), d / "ref.pt"


def test_sbatch_srun_torchrun_trains_to_one_host_accuracy(cluster, reference):
    out, _ = reference
    assert "4 ranks, backend tdx" in out and "rendezvous hostB:" in out, out[-3000:]
    assert _accuracy(out) > 95.0, out[-3000:]
    _no_job_process_left(cluster)


def test_sbatch_srun_alone_trains_to_one_host_accuracy(cluster, tmp_path):
    job = _submit(cluster, tmp_path, script_args=SHORT, launch="srun")
    assert cluster.wait_job(job, JOB_TIMEOUT) == "COMPLETED", _output(tmp_path, job)
    out = _output(tmp_path, job)
    assert "0: training DigitsNet on 1438 digits with 4 ranks" in out, out[-3000:]  # srun --label
    assert _accuracy(out) > 95.0, out[-3000:]
    sacct = cluster.run(["sacct", "-n", "-P", "-j", str(job), "-o", "JobID,State,NodeList"]).stdout
    assert f"{job}.0|COMPLETED|hostB,hostC" in sacct, sacct  # the step ran on both nodes


def test_torchx_slurm_scheduler_runs_tdx_ddp(cluster, tmp_path):
    from importlib.metadata import entry_points

    # `tdx.ddp` once the package is installed (the README's command), else the same component by its path.
    installed = any(e.name == "tdx" for e in entry_points(group="torchx.components"))
    component = "tdx.ddp" if installed else os.path.join(REPO, "torchdist_ext", "torchx_components.py") + ":ddp"
    proc = cluster.run([sys.executable, "-m", "torchx.cli.main", "run", "-s", "slurm", "--wait", component,
                        "-j", "2x2", "--script", EXAMPLE, "--", *SHORT],
                       timeout=JOB_TIMEOUT, check=False, cwd=str(tmp_path), env=_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    handle = re.search(r"slurm://\S+/\d+", proc.stdout + proc.stderr).group(0)
    assert "Job finished: SUCCEEDED" in proc.stderr, proc.stderr
    status = cluster.run([sys.executable, "-m", "torchx.cli.main", "status", handle], cwd=str(tmp_path),
                         env=_env()).stdout
    assert "State: SUCCEEDED" in status, status
    log = cluster.run([sys.executable, "-m", "torchx.cli.main", "log", "--streams", "stdout", handle],
                      cwd=str(tmp_path), env=_env()).stdout
    assert _accuracy(log) > 95.0, log


def test_scancel_leaves_no_process_and_no_requeue(cluster, tmp_path):
    job = _submit(cluster, tmp_path, script_args=LONG, ckpt=tmp_path / "c.pt")
    _wait_output(tmp_path, job, r"epoch +1/", cluster)
    cluster.run(["scancel", str(job)])
    assert cluster.wait_job(job, JOB_TIMEOUT) == "CANCELLED"
    _wait_gone(cluster)  # the ranks checkpoint and exit; SLURM would kill any left after KillWait
    out = _output(tmp_path, job)
    assert "SIGTERM: stopped before step" in out and "cancelled, not requeued" in out, out[-3000:]
    assert cluster.job(job).get("Restarts") == "0"


def _wait_gone(cluster, timeout=120):
    deadline = time.monotonic() + timeout
    while True:
        try:
            _no_job_process_left(cluster)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def test_scontrol_requeue_resumes_bitwise_equal(cluster, reference, tmp_path):
    """An admin's (or preemption's) requeue: SIGTERM, every rank stops at one step, rank 0 checkpoints,
    SLURM requeues the job itself; the second run resumes there and ends equal to the uninterrupted one."""
    ckpt = tmp_path / "c.pt"
    job = _submit(cluster, tmp_path, script_args=LONG, ckpt=ckpt)
    _wait_output(tmp_path, job, r"epoch +2/", cluster)
    cluster.run(["scontrol", "requeue", str(job)])
    assert cluster.wait_job(job, JOB_TIMEOUT) == "COMPLETED", _output(tmp_path, job)
    out = _output(tmp_path, job)
    stopped = re.search(r"SIGTERM: stopped before step (\d+)", out)
    assert stopped and "SLURM is requeueing job" in out, out[-3000:]
    assert f"(step {int(stopped.group(1)) - 1}, restart 0, SLURM restart 1)" in out, out[-3000:]
    assert cluster.job(job).get("Restarts") == "1"
    _same_model(ckpt, reference[1])


def test_time_limit_warning_checkpoints_requeues_and_resumes_bitwise_equal(cluster, reference, tmp_path):
    """--time=1 --signal=USR1@10: SLURM sends the warning when at most 10 s + its 30 s check interval
    are left, so 20-50 s into the job (slurmctld checks every 30 s); the job stops
    every rank at one step, checkpoints and requeues itself. Its second run gets a longer limit (as a
    user would give it) and finishes equal to the uninterrupted run."""
    ckpt = tmp_path / "c.pt"
    job = _submit(cluster, tmp_path, "--time=1", "--signal=USR1@10", script_args=LONG, ckpt=ckpt)
    deadline = time.monotonic() + JOB_TIMEOUT
    while cluster.job(job).get("Restarts") != "1":
        assert time.monotonic() < deadline, _output(tmp_path, job)
        assert cluster.job(job).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"), \
            _output(tmp_path, job)
        time.sleep(0.5)
    cluster.run(["scontrol", "update", f"JobId={job}", "TimeLimit=30"])
    assert cluster.wait_job(job, JOB_TIMEOUT) == "COMPLETED", _output(tmp_path, job)
    out = _output(tmp_path, job)
    stopped = re.search(r"SIGUSR1: stopped before step (\d+)", out)
    assert stopped and f"got SIGUSR1: requeued SLURM job {job}" in out, out[-3000:]
    assert f"(step {int(stopped.group(1)) - 1}, restart 0, SLURM restart 1)" in out, out[-3000:]
    _same_model(ckpt, reference[1])


def _wait_no_pending_rpc(cluster, node, timeout=180):
    """Waits until slurmctld holds no RPC to ``node`` for retry (``sdiag``'s Pending RPCs)."""
    deadline = time.monotonic() + timeout
    while True:
        text = cluster.run(["sdiag"]).stdout
        pending = text[text.find("Pending RPCs"):] if "Pending RPCs" in text else ""
        if not re.search(rf"^\s*\d+: \S+\s+{node}\b", pending, re.M):
            return
        assert time.monotonic() < deadline, f"slurmctld still holds RPCs to {node} after {timeout} s:\n{text}"
        time.sleep(1)


def test_lost_node_fails_naming_it_and_the_requeued_job_resumes_when_it_returns(cluster, tmp_path):
    """hostC crashes mid-job (its slurmd and ranks SIGKILLed): the ranks on hostB fail at once naming
    hostC, srun reports the node failure, SLURM ends the job NODE_FAIL and requeues it. Nothing waits
    without a deadline. When hostC's slurmd is back, the requeued run resumes from the last
    checkpoint and completes.

    The requeued run has the same job and step ids as the first, and slurmctld retries the step
    signal that srun --kill-on-bad-exit sent to the lost node about every 60 s until the node
    answers: a retry that reaches hostC after the new run started there would end that run
    (``sdiag`` lists it as a pending REQUEST_SIGNAL_TASKS to hostC). launch/slurm.sbatch makes a
    requeued run wait until no such RPC to one of its nodes is pending."""
    job = _submit(cluster, tmp_path, script_args=SHORT, ckpt=tmp_path / "c.pt")
    _wait_output(tmp_path, job, r"epoch +2/", cluster)
    cluster.kill_node("hostC")
    deadline = time.monotonic() + JOB_TIMEOUT
    while cluster.job(job).get("Restarts") != "1":  # DOWN after SlurmdTimeout (30 s), then requeued
        assert time.monotonic() < deadline, _output(tmp_path, job) + cluster.logs(["slurmctld"])
        time.sleep(1)
    out = _output(tmp_path, job)
    assert "host 'hostC' (ranks [2, 3]) closed the connection" in out, out[-3000:]
    assert re.search(r"torchdist_ext.run: rank \d \(local rank \d on hostB, pid \d+\) failed", out), out[-3000:]
    assert "srun: error: Node failure on hostC" in out, out[-3000:]
    assert cluster.job(job).get("JobState") == "PENDING"
    cluster.start_slurmd("hostC")
    assert cluster.wait_job(job, JOB_TIMEOUT) == "COMPLETED", _output(tmp_path, job) + cluster.logs(["slurmctld"])
    out = _output(tmp_path, job)
    print(next((line for line in out.splitlines() if "waits for slurmctld's pending RPCs" in line),
               "the requeued run found no pending RPC to its nodes"), file=sys.stderr)
    assert re.search(r"resumed from .* after epoch \d+ \(step \d+, restart 0, SLURM restart 1\)", out), out[-3000:]
    assert _accuracy(out) > 95.0, out[-3000:]
    sacct = cluster.run(["sacct", "-n", "-P", "-D", "-X", "-j", str(job), "-o", "State"]).stdout.split()
    assert sacct == ["NODE_FAIL", "COMPLETED"], sacct


def _wait_node(cluster, node, states, timeout=JOB_TIMEOUT):
    """Waits until sinfo shows ``node`` in one of ``states`` (e.g. "down", "idle"); returns it."""
    deadline = time.monotonic() + timeout
    while True:
        state = cluster.run(["sinfo", "-h", "-N", "-n", node, "-o", "%t"], check=False).stdout.strip().rstrip("*~#!%$@^-")
        if state in states:
            return state
        assert time.monotonic() < deadline, f"{node} is {state!r}, not {states}, after {timeout} s"
        time.sleep(1)


KEEP_SURVIVORS_EXPORT = "--export=ALL,NPROC=2,KEEP_SURVIVORS=1,RDZV_BACKEND=etcd-v3"


@contextlib.contextmanager
def _etcd_env(cluster):
    """A 3-member etcd cluster on the test cluster's hosts, and the jobs' environment pointing at it
    (RDZV_ENDPOINT); the test is skipped, with the reason, where etcd cannot run here."""
    from _etcd import EtcdCluster
    from _etcd import unavailable_reason as etcd_unavailable_reason

    reason = etcd_unavailable_reason()
    if reason:
        pytest.skip(reason)
    with EtcdCluster(cluster.hosts, members=(0, 1, 2)) as etcd:
        yield {**_env(), "RDZV_ENDPOINT": ",".join(f"{h.name}:2379" for h in etcd.members)}


def test_lost_node_is_survived_in_place_and_rejoins_when_it_returns(cluster, tmp_path):
    """In-place recovery inside a SLURM job, and the node growing back: ``sbatch --no-kill`` with
    KEEP_SURVIVORS=1 (srun --no-kill, torchdist_ext.run --keep-survivors) and the rendezvous and
    store in a 3-member etcd cluster on hostA, hostB and hostC; examples/train_ddp.py --elastic on 2
    nodes x 2 ranks. hostC crashes after epoch 2 (its slurmd, ranks and etcd member SIGKILLed): the
    ranks on hostB shrink the group and go on. hostC goes DOWN (set at once with scontrol, which SLURM
    does itself SlurmdTimeout after the crash: the requeue test above waits for that) and SLURM drops
    it from the job, not requeued. Then hostC's slurmd is started again (ReturnToService=2 puts it
    back in service) and the user submits the same script for it with JOIN_JOB=<the job>: its 2
    workers join the running job at a step boundary (parameters and optimizer state from hostB), the
    job finishes at world size 4, and both jobs COMPLETE. The same JOIN_JOB once the job has ended
    fails and starts nothing."""
    epochs = ["--epochs", str(REJOIN_EPOCHS)]
    with _etcd_env(cluster) as env:
        variables = KEEP_SURVIVORS_EXPORT
        job = cluster.sbatch(["--no-kill", variables, f"--output={tmp_path}/job-%j.out", SBATCH, EXAMPLE,
                              "--elastic", *epochs], cwd=str(tmp_path), env=env)
        _wait_output(tmp_path, job, r"epoch +2/", cluster)
        cluster.kill_node("hostC")
        killed = time.monotonic()
        _wait_output(tmp_path, job, r"\[rank0\]:recovered at step", cluster)
        cluster.run(["scontrol", "update", "NodeName=hostC", "State=DOWN", "Reason=crashed"])
        _wait_node(cluster, "hostC", ("down",))
        assert cluster.job(job).get("NodeList") == "hostB", cluster.job(job)
        down = time.monotonic()
        cluster.start_slurmd("hostC")
        _wait_node(cluster, "hostC", ("idle",))
        back = time.monotonic()
        joiner = cluster.sbatch(["--nodelist=hostC", "--nodes=1", f"{variables},JOIN_JOB={job}",
                                 f"--output={tmp_path}/job-%j.out", SBATCH, EXAMPLE, "--elastic", *epochs],
                                cwd=str(tmp_path), env=env)
        _wait_output(tmp_path, job, r"\[rank0\]:admitted at step", cluster)
        admitted = time.monotonic()
        states = [cluster.wait_job(j, JOB_TIMEOUT) for j in (job, joiner)]
        out, joined = _output(tmp_path, job), _output(tmp_path, joiner)
        epochs_at = [re.search(rf"\[rank0\]:{what} at step \d+.*\n(?:.*\n)*?\[rank0\]:epoch +(\d+)/", out)
                     for what in ("recovered", "admitted")]
        print(f"\nhostC killed; DOWN after {down - killed:.0f} s, in service again after {back - down:.0f} s, "
              f"its first worker admitted {admitted - back:.0f} s after the join job was submitted (in epochs "
              f"{[m.group(1) if m else None for m in epochs_at]} of {REJOIN_EPOCHS})", file=sys.stderr)
        assert states == ["COMPLETED", "COMPLETED"], (states, out[-3000:], joined[-3000:],
                                                       cluster.logs(["slurmctld"]))
        recovered = re.search(r"\[rank0\]:recovered at step (\d+): (.*)", out)
        assert recovered and "'world_size': 2" in recovered.group(2), out[-3000:]
        # hostC's ranks told gone: at once when their liveness connections closed, or at lease expiry
        assert all(re.search(rf"rank {r} (\(global {r}\) is gone|went silent)", recovered.group(2)) for r in (2, 3)), \
            recovered.group(2)
        # hostC's 2 workers admitted (together, or one at a time as each announced itself), the last
        # admission back at world size 4, after the recovery
        admissions = re.findall(r"\[rank0\]:admitted at step (\d+): (.*)", out)
        assert admissions and "'world_size': 4" in admissions[-1][1], out[-3000:]
        assert sum(a[1].count("'host': 'hostC'") for a in admissions) == 2, admissions
        assert int(admissions[0][0]) > int(recovered.group(1)), (recovered.group(0), admissions)
        assert "join it (--keep-survivors)" in joined and f"joining job {job}" in joined, joined[-3000:]
        ranks = sorted(int(r) for r in re.findall(r"rank (\d): joined the running job at step \d+ .* as rank \d of [34]",
                                                  joined))
        assert ranks == [2, 3], joined[-3000:]
        assert "[rank0]:final step" in out and _accuracy(out) > 90.0, out[-3000:]
        info = cluster.job(job)
        assert (info.get("Restarts"), info.get("NodeList")) == ("0", "hostB"), info
        assert cluster.job(joiner).get("NodeList") == "hostC"
        late = cluster.sbatch(["--nodelist=hostC", "--nodes=1", f"{variables},JOIN_JOB={job}",
                               f"--output={tmp_path}/job-%j.out", SBATCH, EXAMPLE, "--elastic", *epochs],
                              cwd=str(tmp_path), env=env)
        assert cluster.wait_job(late, JOB_TIMEOUT) == "FAILED", _output(tmp_path, late)
        assert f"no job runs under --rdzv-id=tdx-{job}" in _output(tmp_path, late), _output(tmp_path, late)
        assert "nothing started" in _output(tmp_path, late)
    cluster.wait_idle()
    _wait_no_pending_rpc(cluster, "hostC")
    _wait_gone(cluster)


def _rank_logs(log_dir):
    """The text of every per-rank stdout/stderr file under a torchdist_ext.run --log-dir."""
    texts = []
    for root, _, files in os.walk(log_dir):
        for f in sorted(files):
            if f.endswith(".log"):
                with open(os.path.join(root, f), errors="replace") as fh:
                    texts.append(f"--- {os.path.relpath(os.path.join(root, f), log_dir)}\n{fh.read()}")
    return "\n".join(texts)


def test_lost_batch_host_training_finishes_and_the_job_ends(cluster, tmp_path):
    """The batch host (the first node: the job script, srun, ranks 0-1) crashes mid-training under
    ``sbatch --no-kill`` with KEEP_SURVIVORS=1 and etcd: SLURM drops it from the job and kills the
    batch step, but the job stays RUNNING on hostC, whose ranks shrink the group and finish the
    training (their per-rank logs under LOG_DIR: srun's output forwarding died with the batch host).
    Once hostC's workers exited 0, its torchdist_ext.run finds the batch host gone from the job and
    scancels it: the job ends CANCELLED, no process is left, hostC is idle again."""
    with _etcd_env(cluster) as env:
        # --time: without the cancel the job would hold hostC until its time limit (it ends TIMEOUT)
        job = cluster.sbatch(["--no-kill", "--time=5", KEEP_SURVIVORS_EXPORT,
                              f"--output={tmp_path}/job-%j.out", SBATCH, EXAMPLE, "--elastic", "--epochs", "40"],
                             cwd=str(tmp_path), env=env)
        _wait_output(tmp_path, job, r"epoch +2/", cluster)
        assert cluster.job(job).get("BatchHost") == "hostB", cluster.job(job)
        cluster.kill_node("hostB")
        killed = time.monotonic()
        # SLURM does this itself SlurmdTimeout (30 s) after the crash (the requeue test waits for that)
        cluster.run(["scontrol", "update", "NodeName=hostB", "State=DOWN", "Reason=crashed"])
        state = cluster.wait_job(job, JOB_TIMEOUT)
        ended = time.monotonic()
        logs = _rank_logs(tmp_path / "logs" / str(job))
        assert state == "CANCELLED", (state, logs[-3000:], cluster.logs(["slurmctld"]))
        recovered = re.search(r"recovered at step (\d+): (.*)", logs)
        assert recovered and "'world_size': 2" in recovered.group(2) and "host 'hostB'" in recovered.group(2), \
            logs[-3000:]
        assert "final step" in logs and _accuracy(logs) > 90.0, logs[-3000:]
        sacct = cluster.run(["sacct", "-n", "-P", "-j", str(job), "-o", "JobID,State,NodeList"]).stdout
        print(f"\nbatch host killed; job {state} {ended - killed:.0f} s later; sacct:\n{sacct}", file=sys.stderr)
        assert re.search(rf"^{job}\|CANCELLED by 0\|hostC$", sacct, re.M), sacct
    _wait_gone(cluster)  # the etcd members stopped with the context above
    _wait_node(cluster, "hostC", ("idle",))
    cluster.start_slurmd("hostB")
    cluster.wait_idle()
    _wait_no_pending_rpc(cluster, "hostB")
