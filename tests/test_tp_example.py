"""examples/train_tp.py trains a character-level GPT under torchrun on "tdx" with tp=2 x pp=2."""
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_tp_gpt_learns():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           os.path.join(REPO, "examples", "train_tp.py"), "--steps", "80", "--log-every", "40"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "train_tp: tp=2 x pp=2 on 4 ranks (tdx)" in out, out
    steps = re.findall(r"step +(\d+)/80 loss ([\d.]+)", out)
    assert [s[0] for s in steps] == ["1", "40", "80"], out  # progress from one rank only
    held = float(re.search(r"held-out loss ([\d.]+)", out).group(1))
    assert held < 3.3 < float(steps[0][1]), out  # uniform over 92 characters is 4.52 nats
