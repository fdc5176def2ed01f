"""torchdist_ext.PreemptionHandler without a cluster: one decision for all ranks, the requeue rules
(against a stand-in `scontrol` that answers as SLURM 22.05 does in each case), and the example's
mid-epoch checkpoint resuming bitwise equal; when a surviving launcher ends a job that lost its batch
host (end_slurm_job_without_batch_host). On a real cluster: tests/test_slurm.py."""
import os
import re
import signal
import subprocess
import sys

import pytest

from _dist import run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _agree(rank, world_size):
    """Rank 1 gets SIGTERM before step 3, rank 2 SIGUSR1 before step 5: all stop at 3 with SIGTERM, and
    the warning signal wins when both were seen by the time of the check."""
    import torchdist_ext

    stop = torchdist_ext.PreemptionHandler()
    stopped_at = None
    for step in range(10):
        if rank == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        if stop.should_stop():
            stopped_at = step
            break
    first = (stopped_at, stop.stopped.name, stop.exit_code)
    stop.stopped = None  # a second decision, now with both signals seen
    if rank == 2:
        os.kill(os.getpid(), signal.SIGUSR1)
    stop.should_stop()
    stop.restore()
    return first, stop.stopped.name, signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_every_rank_stops_at_the_same_step():
    results = run_ranks(_agree, 3)
    for first, second, restored in results:
        assert first == (3, "SIGTERM", 143) and second == "SIGUSR1" and restored, results


def _scontrol(tmp_path, show):
    """A stand-in scontrol: `show job -o` prints `show`, `requeue` records its job id."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    path = bindir / "scontrol"
    path.write_text(f'#!/bin/sh\nif [ "$1" = requeue ]; then echo "$2" >> "{tmp_path}/requeued"; exit 0; fi\n'
                    f'echo "{show}"\n')
    path.chmod(0o755)
    return str(bindir)


@pytest.mark.parametrize("received, show, restart, requeued", [
    ("SIGUSR1", "JobId=7 JobState=RUNNING Reason=None Restarts=0", "", True),  # the warning signal
    ("SIGTERM", "JobId=7 JobState=COMPLETING Reason=TimeLimit Restarts=0", "", True),  # time limit
    ("SIGTERM", "JobId=7 JobState=COMPLETING Reason=TimeLimit Restarts=2", "2", True),  # ... of a requeued run
    ("SIGTERM", "JobId=7 JobState=COMPLETING Reason=None Restarts=0", "", False),  # scancel
    ("SIGTERM", "JobId=7 JobState=COMPLETING Reason=None Restarts=1", "", False),  # scontrol requeue, preemption
])
def test_requeue_rules(tmp_path, monkeypatch, capsys, received, show, restart, requeued):
    import torchdist_ext

    monkeypatch.setenv("PATH", _scontrol(tmp_path, show) + os.pathsep + os.environ["PATH"])
    stop = torchdist_ext.PreemptionHandler()
    try:
        stop.received = signal.Signals[received]
        env = {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": restart}
        assert stop.requeue(env) is requeued, capsys.readouterr().err
        assert (tmp_path / "requeued").exists() is requeued
        assert stop.requeue({}) is False and "not in a SLURM job" in capsys.readouterr().err
    finally:
        stop.restore()
    with pytest.raises(ValueError, match="signals is empty"):
        torchdist_ext.PreemptionHandler(signals=())


@pytest.mark.parametrize("show, cancelled", [
    ("JobId=7 JobState=RUNNING BatchFlag=1 NodeList=hostC BatchHost=hostB", True),  # batch host dropped
    ("JobId=7 JobState=RUNNING BatchFlag=1 NodeList=node[02-03] BatchHost=node01", True),
    ("JobId=7 JobState=RUNNING BatchFlag=1 NodeList=node[01,03] BatchHost=node01", False),  # another node lost
    ("JobId=7 JobState=RUNNING BatchFlag=0 NodeList=hostC BatchHost=hostB", False),  # salloc: no job script
    ("", False),  # scontrol knows no such job
])
def test_job_without_batch_host_is_cancelled(tmp_path, monkeypatch, capsys, show, cancelled):
    from torchdist_ext.launch import end_slurm_job_without_batch_host

    bindir = _scontrol(tmp_path, show)
    scancel = os.path.join(bindir, "scancel")
    with open(scancel, "w") as f:
        f.write(f'#!/bin/sh\necho "$1" >> "{tmp_path}/cancelled"\n')
    os.chmod(scancel, 0o755)
    monkeypatch.setenv("PATH", bindir + os.pathsep + os.environ["PATH"])
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert end_slurm_job_without_batch_host() is cancelled
    finally:
        signal.signal(signal.SIGTERM, before)
    assert (tmp_path / "cancelled").exists() is cancelled
    if cancelled:
        assert (tmp_path / "cancelled").read_text() == "7\n"
        assert "lost its batch host" in capsys.readouterr().err


def _train(ckpt, *extra, wait_for=None):
    """examples/train_ddp.py on 2 local workers; with wait_for, SIGUSR1 to worker 1 once it is printed."""
    cmd = [sys.executable, os.path.join(REPO, "examples", "train_ddp.py"), "--nproc", "2", "--epochs", "2",
           "--checkpoint", str(ckpt), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = []
    for line in proc.stdout:
        out.append(line)
        if wait_for and wait_for in line:
            children = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
            os.kill(int(children[1]), signal.SIGUSR1)
            wait_for = None
    return proc.wait(timeout=300), "".join(out)


def test_example_stops_mid_epoch_and_resumes_bitwise_equal(tmp_path):
    import torch

    code, out = _train(tmp_path / "ref.pt")
    assert code == 0, out
    code, out = _train(tmp_path / "c.pt", wait_for="epoch   1/2")
    assert code == 128 + signal.SIGUSR1, out
    stopped = re.search(r"SIGUSR1: stopped before step (\d+) \(epoch 2, batch (\d+)\)", out)
    assert stopped and "not in a SLURM job" in out and out.count("exited with status 138") == 2, out
    code, out = _train(tmp_path / "c.pt")
    assert code == 0, out
    batch, step = int(stopped.group(2)), int(stopped.group(1)) - 1
    where = f"in epoch 2 before batch {batch}" if batch else "after epoch 1"  # batch 0: the epoch's checkpoint
    assert f"{where} (step {step}," in out, out
    ref, got = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "c.pt")
    assert ref["step"] == got["step"] and all(torch.equal(ref["model"][k], got["model"][k]) for k in ref["model"])
