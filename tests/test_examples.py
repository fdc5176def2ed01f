"""The examples run under torchrun on backend "tdx" and do what their docstrings say."""
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(script, *args, nproc=2, timeout=300):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(REPO, "examples", script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_train_ddp_learns_and_resumes(tmp_path):
    ckpt = str(tmp_path / "digits.pt")
    out = torchrun("train_ddp.py", "--epochs", "2", "--checkpoint", ckpt)
    assert "epoch   2/2" in out and os.path.exists(ckpt)
    out = torchrun("train_ddp.py", "--epochs", "4", "--checkpoint", ckpt)
    assert "resumed from" in out and "after epoch 2" in out
    assert "epoch   1/4" not in out and "epoch   3/4" in out  # no repeated epochs
    acc = float(re.search(r"final test accuracy ([\d.]+)%", out).group(1))
    assert acc > 90.0, out


def test_train_ddp_elastic_survives_a_killed_rank_in_place():
    cmd = [sys.executable, os.path.join(REPO, "examples", "train_ddp.py"), "--elastic", "--nproc", "3",
           "--epochs", "3", "--fail-at-step", "8", "--fail-rank", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "injected failure before step 8" in out and "recovered at step 8" in out, out
    assert "worker 1 exited with status -9" in out, out  # SIGKILLed; the two others finished
    assert "epoch   3/3" in out, out
    acc = float(re.search(r"final test accuracy ([\d.]+)%", out).group(1))
    assert acc > 90.0, out
