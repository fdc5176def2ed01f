"""The benchmark commands run end to end and print their tables (tiny sizes; no timing is asserted)."""
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_module(module, *args, timeout=240, check=True):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=env)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout
    return proc


def run_bench(*args, **kw):
    return run_module("torchdist_ext.bench", *args, **kw)


TINY_COLLECTIVE = ("--collective", "all_reduce", "--world-size", "2", "--min-bytes", "4K", "--max-bytes", "16K",
                   "--step-factor", "4", "--iters", "3", "--warmup", "1", "--mem-bytes", "0")


@pytest.mark.parametrize("form", ["subcommand", "bare"])
def test_bench_collectives_table_has_every_size(form):
    out = run_bench(*(("collectives",) if form == "subcommand" else ()), *TINY_COLLECTIVE)
    assert "python -m torchdist_ext.bench collectives" in out, out
    rows = table_rows(out, "bytes")
    assert [r.split()[:2] for r in rows] == [["4096", "4K"], ["16384", "16K"]], out
    assert all(r.count("x") >= 1 for r in rows), out  # the tdx/gloo speedup column is filled


def test_bench_copy_column_gives_copy_share_from_1mb():
    out = run_bench("collectives", "--collective", "all_reduce", "--world-size", "2", "--min-bytes", "256K",
                    "--max-bytes", "1M", "--step-factor", "4", "--iters", "3", "--warmup", "1", "--mem-bytes", "0",
                    "--backends", "tdx,copy")
    rows = table_rows(out, "bytes")
    assert [r.split()[1] for r in rows] == ["256K", "1M"], out
    assert not rows[0].rstrip().endswith("%"), out  # below 1 MB both are latency bound: no share
    assert re.search(r"\d+%$", rows[1].rstrip()), out


def test_bench_unknown_subcommand_names_the_choices():
    proc = run_bench("allreduce", check=False)
    assert proc.returncode != 0
    assert "unknown benchmark 'allreduce'" in proc.stderr and "collectives, ddp, fsdp, pipeline" in proc.stderr


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
    out = run_bench("ddp", "--world-size", "2", "--bucket-mb", "1,25", "--rounds", "2",
                     "--steps", "2", "--warmup", "1", "--model", model, "--width", "32", "--depth", "2",
                     "--vocab", "1000")
    rows = table_rows(out, "bucket_mb")
    assert [r.split()[0] for r in rows] == ["1", "25"], out
    for r in rows:
        assert len(re.findall(r"\d+\.\d+x", r)) == 2, out  # both ratio columns filled


def test_bench_pipeline_reports_every_microbatch_count_with_repeats():
    out = run_bench("pipeline", "--world-size", "2", "--microbatches", "2,4", "--steps", "2",
                     "--warmup", "1", "--repeats", "2", "--width", "32", "--depth", "1", "--batch", "8")
    assert "median of 2 repeats" in out, out
    rows = table_rows(out, "m")
    assert [r.split()[0] for r in rows] == ["2", "4"], out
    assert all("n/a" not in r for r in rows), out  # torch's 1F1B runs at m >= stages


def test_bench_pipeline_zero_bubble_runs_ours_and_torchs_and_plots(tmp_path):
    png = tmp_path / "zb.png"
    out = run_bench("pipeline-zb", "--world-size", "2", "--microbatches", "4", "--steps", "1", "--warmup", "0",
                    "--width", "32", "--depth", "1", "--batch", "8", "--plot", str(png))
    rows = table_rows(out, "m")
    assert [r.split()[1] for r in rows] == ["1F1B", "ZB-H1", "ZB-V", "DualPipeV"], out
    assert all("n/a" not in r and "did not run" not in r for r in rows), out  # torch's four ran too
    assert png.stat().st_size > 10_000, out


def test_bench_fsdp_runs():
    out = run_bench("fsdp", "--world-size", "2", "--width", "32", "--depth", "2", "--steps",
                     "2", "--warmup", "1", "--rounds", "1")
    rows = table_rows(out, "config")
    assert [r.split()[0] for r in rows] == ["zero1", "zero2", "zero3", "ddp", "fsdp2"], out
    zero3 = rows[2].split()
    assert abs(float(zero3[5]) - 1.0) < 0.05, out  # stage 3 keeps 1/N of the state (plus padding)


def test_bench_plan_shows_the_route_of_every_collective():
    out = run_bench("plan", "--world-size", "4", "--nproc-per-node", "2", "--link", "1gbit", "--sizes", "4K,16M")
    rows = table_rows(out, "collective")
    assert [r.split()[0] for r in rows].count("all_reduce") == 2, out
    by = {(r.split()[0], r.split()[1]): r for r in rows}
    assert by[("all_reduce", "16M")].split()[2] == "sliced", out
    assert by[("broadcast", "4K")].split()[2] == "sliced", out  # two hosts: one send across
    assert by[("gather", "4K")].split()[2] == "flat", out
    one_host = table_rows(run_bench("plan", "--world-size", "2", "--collective", "all_reduce", "--sizes", "4K,1M"),
                          "collective")
    assert [r.split()[3] for r in one_host] == ["one-shot", "reduce-scatter+all-gather"], one_host
    bad = run_bench("plan", "--dtype", "float33", check=False)
    assert bad.returncode != 0 and "unknown dtype 'float33'; use one of float32" in bad.stderr, bad.stderr


def test_bench_ps_replicas_doubles_the_pushed_bytes():
    out = run_bench("ps-replicas", "--world-size", "3", "--servers", "2", "--steps", "3", "--warmup", "1",
                    "--rounds", "1", "--width", "16")
    rows = [r.split("|")[1:-1] for r in out.splitlines() if r.startswith("| ") and r.split("|")[1].strip() in
            ("sync", "async", "ssp")]
    assert [r[0].strip() for r in rows] == ["sync", "async", "ssp"], out
    for r in rows:
        sent, sent_rep, got, got_rep = (int(v) for v in r[4:8])
        assert sent_rep == 2 * sent, out   # each push goes to the shard's server and to its replica's
        assert got_rep == got + 2 * 48, out  # plus one 48-byte acknowledgement per replica
