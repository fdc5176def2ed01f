"""torchdist_ext.run (torchrun with rank prefixes and failure reports) and the example launched as
users do: elastic restart after a killed worker, and 2 torchrun "nodes" x 2 processes on one machine."""
import os
import socket
import subprocess
import sys
import uuid

import torch

from torchdist_ext.run import failure_report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "train_ddp.py")


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _launch(launcher, *args, env=None, timeout=240):
    cmd = [sys.executable, "-m", launcher, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or _env(), cwd=REPO)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def test_failed_rank_is_named_with_its_log(tmp_path):
    logs = tmp_path / "logs"
    proc = _launch("torchdist_ext.run", "--standalone", "--nproc-per-node=2", f"--log-dir={logs}",
                   EXAMPLE, "--epochs", "1", "--fail-at-step", "3", "--fail-rank", "1")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    line = next((ln for ln in out.splitlines() if ln.startswith("torchdist_ext.run: rank 1 ")), None)
    assert line is not None and "failed: killed by signal 9 (SIGKILL)" in line, out
    log = line.split("its output: ")[1].split(",")[0].split(";")[0]
    assert log.startswith(str(logs)) and log.endswith(os.path.join("attempt_0", "1", "stderr.log")), line
    with open(log) as f:
        assert "rank 1: injected failure before step 3" in f.read()
    # Console lines carry the global rank.
    assert "[rank1]:rank 1: injected failure" in out and "[rank0]:training DigitsNet" in out, out


def test_keep_survivors_lets_elastic_training_finish_in_place(tmp_path):
    """--keep-survivors: rank 1 of 3 SIGKILLs itself; torchrun's agent leaves the other workers running,
    they shrink the group and finish the epoch (examples/train_ddp.py --elastic), and the job succeeds."""
    proc = _launch("torchdist_ext.run", "--standalone", "--nproc-per-node=3", "--keep-survivors",
                   f"--log-dir={tmp_path / 'logs'}", EXAMPLE, "--elastic", "--epochs", "1", "--fail-at-step", "5",
                   "--fail-rank", "1")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "local rank 1 on" in out and "failed: killed by signal 9 (SIGKILL); the other workers go on" in out, out
    assert "[rank0]:recovered at step 5" in out and "'world_size': 2" in out, out
    assert "[rank0]:final step" in out and "2 of 3 workers on" in out, out


def test_keep_survivors_still_fails_when_every_worker_fails(tmp_path):
    proc = _launch("torchdist_ext.run", "--standalone", "--nproc-per-node=2", "--keep-survivors",
                   f"--log-dir={tmp_path / 'logs'}", EXAMPLE, "--epochs", "1", "--fail-rank", "7", "--fail-at-step", "1")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "is not a rank of this job" in out and "torchdist_ext.run: rank 0 (local rank 0" in out, out


def test_join_needs_keep_survivors_and_the_etcd_rendezvous():
    """--join only joins through the workers' store in etcd (a job that runs is found there; launch/slurm.sbatch's
    JOIN_JOB, tested on a real cluster in tests/test_slurm.py); elsewhere it is refused before anything starts."""
    proc = _launch("torchdist_ext.run", "--join", "--keep-survivors", "--standalone", "--nproc-per-node=1", EXAMPLE)
    assert proc.returncode == 2 and "--join joins a running elastic job" in proc.stderr, proc.stderr
    assert "it needs --keep-survivors and --rdzv-backend=etcd-v3" in proc.stderr, proc.stderr


def test_failure_report_for_an_exception():
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    f = ProcessFailure(local_rank=2, pid=4242, exitcode=1, error_file="<N/A>")
    text = failure_report({3: f}, "hostA")
    assert text.startswith("torchdist_ext.run: rank 3 (local rank 2 on hostA, pid 4242) failed: exit code 1; ")
    assert "console only" in text


def test_elastic_restart_resumes_with_no_lost_or_repeated_steps(tmp_path):
    """A worker SIGKILLs itself in epoch 2; torchrun --max-restarts=1 restarts the group, which resumes
    from the epoch-1 checkpoint and ends with the same step count and bitwise the same model and
    optimizer state as a run without failure."""
    ref, ela = str(tmp_path / "ref.pt"), str(tmp_path / "elastic.pt")
    once = tmp_path / "failed-once"
    proc = _launch("torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   EXAMPLE, "--epochs", "2", "--checkpoint", ref)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = _launch("torchdist_ext.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
                   f"--log-dir={tmp_path / 'logs'}", EXAMPLE, "--epochs", "2", "--checkpoint", ela,
                   "--fail-at-step", "30", "--fail-once-file", str(once))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert once.exists() and "injected failure before step 30" in out, out
    assert "[rank0]:resumed from" in out and "after epoch 1 (step 23, restart 1)" in out, out
    assert "[rank0]:epoch   2/2" in out and "samples/s" in out, out
    a, b = _model(ref), _model(ela)
    assert a["step"] == b["step"] == 46 and a["epoch"] == b["epoch"] == 1
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for pid, st in a["optimizer"]["state"].items():
        assert torch.equal(st["momentum_buffer"], b["optimizer"]["state"][pid]["momentum_buffer"]), pid


def test_two_nodes_of_two_match_one_node_of_four(tmp_path):
    """2 torchrun agents ("nodes", distinct TDX_NODE_ID, c10d rendezvous on 127.0.0.1) x 2 processes
    train to the same model as 4 processes on one node. tdx runs hierarchically across the
    simulated nodes, whose all_reduce folds in another order than on one host, so the models agree
    to a tolerance rather than bit for bit."""
    one, two = str(tmp_path / "one.pt"), str(tmp_path / "two.pt")
    proc = _launch("torch.distributed.run", "--standalone", "--nproc-per-node=4",
                   EXAMPLE, "--epochs", "1", "--checkpoint", one)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    port, job = _free_port(), f"tdx-test-{uuid.uuid4().hex[:8]}"
    nodes = [
        subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
                          "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={job}",
                          "--rdzv-conf=join_timeout=120", EXAMPLE, "--epochs", "1", "--checkpoint", two],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                         env=_env(TDX_NODE_ID=f"simulated-node-{i}"))
        for i in range(2)
    ]
    outs = []
    try:
        for p in nodes:
            outs.append(p.communicate(timeout=240)[0])
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in nodes), "\n".join(outs)
    assert any("with 4 ranks, backend tdx" in o for o in outs), "\n".join(outs)
    a, b = _model(one), _model(two)
    assert a["step"] == b["step"] == 12
    for k in a["model"]:
        if a["model"][k].is_floating_point():
            torch.testing.assert_close(b["model"][k], a["model"][k], rtol=1e-4, atol=1e-5, msg=k)
        else:
            assert torch.equal(a["model"][k], b["model"][k]), k
