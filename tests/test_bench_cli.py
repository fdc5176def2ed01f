"""The benchmark commands run end to end and print their tables (tiny sizes; no timing is asserted)."""
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_module(module, *args, timeout=240):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def table_rows(out, first_column):
    """The data rows of the table whose header starts with `first_column` (until a comment line)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split() and line.split()[0] == first_column)
    rows = []
    for line in lines[start + 1:]:
        if not line.strip() or line.startswith("#"):
            break
        rows.append(line)
    return rows


@pytest.mark.parametrize("model", ["mlp", "embedding"])
def test_bench_ddp_sweeps_every_bucket_size(model):
    out = run_module("torchdist_ext.bench_ddp", "--world-size", "2", "--bucket-mb", "1,25", "--rounds", "2",
                     "--steps", "2", "--warmup", "1", "--model", model, "--width", "32", "--depth", "2",
                     "--vocab", "1000")
    rows = table_rows(out, "bucket_mb")
    assert [r.split()[0] for r in rows] == ["1", "25"], out
    for r in rows:
        assert len(re.findall(r"\d+\.\d+x", r)) == 2, out  # both ratio columns filled


def test_bench_pipeline_reports_every_microbatch_count_with_repeats():
    out = run_module("torchdist_ext.bench_pipeline", "--world-size", "2", "--microbatches", "2,4", "--steps", "2",
                     "--warmup", "1", "--repeats", "2", "--width", "32", "--depth", "1", "--batch", "8")
    assert "median of 2 repeats" in out, out
    rows = table_rows(out, "m")
    assert [r.split()[0] for r in rows] == ["2", "4"], out
    assert all("n/a" not in r for r in rows), out  # torch's 1F1B runs at m >= stages


def test_bench_fsdp_runs():
    out = run_module("torchdist_ext.bench_fsdp", "--world-size", "2", "--width", "32", "--depth", "2", "--steps",
                     "2", "--warmup", "1", "--rounds", "1")
    rows = table_rows(out, "config")
    assert [r.split()[0] for r in rows] == ["zero1", "zero2", "zero3", "ddp", "fsdp2"], out
    zero3 = rows[2].split()
    assert abs(float(zero3[5]) - 1.0) < 0.05, out  # stage 3 keeps 1/N of the state (plus padding)
