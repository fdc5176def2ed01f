"""examples/train_pipeline.py trains under torchrun on backend "tdx" with pp=2 (1F1B, and zero-bubble ZB-V with
two stages per rank) and reports progress."""
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("schedule,stages", [("1f1b", 2), ("zbv", 4)])
def test_train_pipeline_learns_digits(schedule, stages):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(REPO, "examples", "train_pipeline.py"), "--epochs", "3", "--schedule", schedule]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert f"pipeline: {stages} stages x 1 replicas on 2 ranks (tdx), schedule {schedule}" in out, out
    epochs = re.findall(r"epoch +(\d)/3 loss ([\d.]+) +\d+ samples/s test accuracy ([\d.]+)%", out)
    assert [e[0] for e in epochs] == ["1", "2", "3"], out  # one progress line per epoch, from one rank
    losses = [float(e[1]) for e in epochs]
    assert losses[-1] < losses[0] / 2, out
    acc = float(re.search(r"final test accuracy ([\d.]+)%", out).group(1))
    assert acc > 85.0, out
