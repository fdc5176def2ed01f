"""examples/train_ps.py trains on digits under torchrun with 2 servers and 2 SSP workers;
examples/train_ps_recsys.py trains a sparse embedding table; the ps benchmark prints its rows."""
import re

from test_examples import torchrun


def test_train_ps_learns_with_two_servers_and_resumes(tmp_path):
    ckpt = str(tmp_path / "ps.pt")
    out = torchrun("train_ps.py", "--servers", "2", "--mode", "ssp", "--staleness", "2", "--epochs", "2",
                   "--checkpoint", ckpt, nproc=4)
    assert "training on 2 workers, 2 server(s), mode ssp (s=2), backend tdx" in out, out
    assert len(re.findall(r"epoch +\d/2 ", out)) == 2, out  # one line per epoch, from one worker
    for r in (0, 1):
        summary = re.search(rf"server rank {r}: (\d+) updates .* staleness histogram \{{(.*)\}}, "
                            r"workers finished \[2, 3\], lost \[\]", out)
        assert summary, out
        assert max(int(k) for k in re.findall(r"(\d+):", summary.group(2))) <= 2, out
    # resumed with 1 server and 1 worker: the servers' state is saved by parameter name
    out = torchrun("train_ps.py", "--servers", "1", "--mode", "ssp", "--staleness", "2", "--epochs", "3",
                   "--checkpoint", ckpt, nproc=2)
    assert "resumed from" in out and "after epoch 2" in out, out
    assert re.findall(r"epoch +(\d)/3 ", out) == ["3"], out
    summary = re.search(r"server rank 0: (\d+) updates .* staleness histogram \{(.*)\}, "
                        r"workers finished \[1\], lost \[\]", out)
    assert summary and int(summary.group(1)) > 2 * 45, out  # counts on from the updates of epochs 1-2
    assert float(re.search(r"final test accuracy ([\d.]+)%", out).group(1)) > 90.0, out


def test_train_ps_recsys_learns_with_sparse_rows_under_ssp():
    out = torchrun("train_ps_recsys.py", "--servers", "2", "--mode", "ssp", "--staleness", "1", "--users", "2000",
                   "--items", "2000", "--steps", "100", nproc=4)
    assert "training on 2 workers, 2 server(s), mode ssp, table 4000 x 16 (sparse), backend tdx" in out, out
    sent, received = (int(v) for v in re.search(r"bytes per step on this worker: sent (\d+), received (\d+)",
                                                   out).groups())
    assert 0 < sent < 256000 / 4 and 0 < received < 256000 / 4, out  # a fraction of the 256 KB table
    for r in (0, 1):
        hist = re.search(rf"server rank {r}: 200 updates from 200 pushes .* staleness histogram \{{(.*)\}}", out)
        assert hist and max(int(k) for k in re.findall(r"(\d+):", hist.group(1))) <= 1, out
    assert float(re.search(r"final held-out accuracy ([\d.]+)%", out).group(1)) > 85.0, out


def test_bench_ps_prints_every_configuration_and_writes_the_plot(tmp_path):
    from test_bench_cli import run_bench

    png = tmp_path / "ps.png"
    out = run_bench("ps", "--world-size", "3", "--seconds", "0.3", "--rounds", "1", "--width", "32", "--batch", "16",
                    "--target", "50", "--plot", str(png))
    assert out.startswith("# python -m torchdist_ext.bench ps"), out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line and not line.startswith("#")}
    assert set(rows) == {"config", "ddp", "ps-sync", "ssp-2", "ssp-4", "async"}, out
    assert rows["ddp"][4] == "1.00x" and rows["ddp"][1] == "3" and rows["ps-sync"][1] == "2", out
    assert rows["ps-sync"][-2] == "0" and int(rows["ssp-2"][-2]) <= 2 and int(rows["ssp-4"][-2]) <= 4, out
    assert png.stat().st_size > 10_000
