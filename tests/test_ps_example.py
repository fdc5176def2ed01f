"""examples/train_ps.py trains on digits under torchrun with 2 servers and 2 SSP workers."""
import re

from test_examples import torchrun


def test_train_ps_learns_with_two_servers():
    out = torchrun("train_ps.py", "--servers", "2", "--mode", "ssp", "--staleness", "2", "--epochs", "3",
                   nproc=4)
    assert "training on 2 workers, 2 server(s), mode ssp (s=2), backend tdx" in out, out
    assert len(re.findall(r"epoch +\d/3 ", out)) == 3, out  # one line per epoch, from one worker
    for r in (0, 1):
        summary = re.search(rf"server rank {r}: (\d+) updates .* staleness histogram \{{(.*)\}}, "
                            r"workers finished \[2, 3\], lost \[\]", out)
        assert summary, out
        assert max(int(k) for k in re.findall(r"(\d+):", summary.group(2))) <= 2, out
    assert float(re.search(r"final test accuracy ([\d.]+)%", out).group(1)) > 90.0, out
