"""python -m torchdist_ext.bench elastic: the command runs end to end, its ranks may die on purpose,
and its options are checked (tiny sizes; no timing is asserted)."""
import pytest

from test_bench_cli import run_bench
from torchdist_ext._spawn import spawn_ranks
from torchdist_ext.bench import elastic


def test_overhead_prints_a_row_per_rank():
    out = run_bench("elastic", "overhead", "--steps", "5")
    assert "# python -m torchdist_ext.bench elastic overhead --steps 5" in out, out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["rank", "DDP"])
    assert [line.split()[0] for line in lines[header + 1:header + 3]] == ["0", "1"], out


def test_rejoin_prints_a_row_per_rank():
    out = run_bench("elastic", "rejoin", "--steps", "5")
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["rank", "rejoin=False"])
    assert [line.split()[0] for line in lines[header + 1:header + 3]] == ["0", "1"], out


def test_a_rank_that_exits_is_reported_and_its_peer_returns():
    out = spawn_ranks(elastic._notice_body, 2, "sys_exit", env={"TDX_FAILURE_NOTICE": "1"}, timeout=120)
    assert out[1][0] == "error" and "SystemExit: 3" in out[1][1], out[1]
    status, seconds = out[0]
    assert status == "ok" and 0 < seconds < 60, out[0]  # the peer raised instead of waiting out the timeout


@pytest.mark.parametrize("argv, words", [
    (["ddp", "--ranks", "4"], "--ranks does not apply to `elastic ddp`"),
    (["fsdp", "--ranks", "1"], "needs --ranks >= 2"),
    (["pipeline", "--steps", "0"], "--steps must be at least 1"),
    (["nothing"], "invalid choice"),
])
def test_bad_options_are_named(argv, words, capsys):
    with pytest.raises(SystemExit):
        elastic.parse_args(argv)
    assert words in capsys.readouterr().err


def test_defaults_per_part():
    args = elastic.parse_args(["fsdp"])
    assert (args.ranks, args.steps, args.rounds, args.batch) == (2, 200, 3, 32)
    assert elastic.parse_args(["ddp"]).rounds == 9
