"""``python -m torchdist_ext.bench recovery`` without root: its options, its plan (what each
framework's hosts run), its figures from a run's step log, and one rank of its worker.

The runs themselves need root and test hosts (and torchft for one of the three): they are a
benchmark, run by hand (docs/elastic.md), never in the default test run.
"""
import json
import os
import re
import socket
import subprocess
import sys

import pytest

from torchdist_ext.bench import COMMANDS
from torchdist_ext.bench.recovery import commands, joiner_timeline, parse_args, plan, recovery_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ["hostA", "hostB", "hostC"]


def test_recovery_is_a_bench_subcommand():
    assert COMMANDS["recovery"] == "torchdist_ext.bench.recovery"


@pytest.mark.parametrize("argv, words", [
    (["--frameworks", "ours,mpi"], "--frameworks ours,mpi: choose from ours, torchft, torchrun"),
    (["--hosts", "2"], "--hosts 2: ours needs 3"),
    (["--nproc-per-node", "2"], "--nproc-per-node 2: torchft runs one replica group a host"),
    (["--steps", "20", "--kill-step", "20"], "--kill-step 20: must be between 1 and --steps - 1 (19)"),
    (["--steps", "40", "--kill-step", "30", "--rejoin-after", "10"], "--rejoin-after 10: the survivors must"),
])
def test_bad_options_say_what_is_wrong(argv, words):
    with pytest.raises(SystemExit, match=re.escape(words)):
        parse_args(argv)


def test_two_hosts_and_two_ranks_a_host_are_fine_without_ours_and_torchft():
    args = parse_args(["--frameworks", "torchrun", "--hosts", "2", "--nproc-per-node", "2", "--no-rejoin"])
    assert (args.hosts, args.nproc_per_node, args.rejoin_after) == (2, 2, 0)


def test_plan_interleaves_the_frameworks_round_by_round():
    args = parse_args(["--rounds", "2"])
    assert plan(args) == [(0, "ours"), (0, "torchft"), (0, "torchrun"), (1, "ours"), (1, "torchft"), (1, "torchrun")]


def _flags(argv):
    return set(a for a in argv if a.startswith("-"))


def test_every_framework_runs_the_same_worker_and_kill_schedule_on_every_host(tmp_path):
    args = parse_args(["--torchft-python", "/venv/bin/python", "--kill-step", "7", "--detection-s", "3"])
    plans = {fw: commands(args, fw, NAMES, str(tmp_path), "10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379")
             for fw in ("ours", "torchft", "torchrun")}
    for fw, cmds in plans.items():
        assert [i for i, _, _ in cmds] == [0, 1, 2], fw
        for _, argv, env in cmds:
            worker = argv[argv.index("torchdist_ext.bench._recovery_worker") + 1:]
            assert worker[worker.index("--framework") + 1] == fw
            assert worker[worker.index("--kill-step") + 1] == "7" and worker[worker.index("--victim") + 1] == "hostC"
            assert "TDX_BENCH_RETURNING" not in env
    ours = plans["ours"][0]
    assert {"--keep-survivors", "--rdzv-backend=etcd-v3", "--nnodes=3"} <= _flags(ours[1])
    assert ours[2]["TDX_FAILURE_DETECTION_S"] == 3.0
    torchrun = plans["torchrun"][1][1]
    assert {"--nnodes=2:3", "--max-restarts=1", "--rdzv-endpoint=hostA:29400", "--ckpt-every"} <= _flags(torchrun)
    ft_argv, ft_env = plans["torchft"][2][1], plans["torchft"][2][2]
    assert ft_argv[0] == "/venv/bin/python" and "http://hostA:29510" in ft_argv
    assert (ft_env["MASTER_ADDR"], ft_env["WORLD_SIZE"]) == ("hostC", 1)
    back = commands(args, "torchft", NAMES, str(tmp_path), returning=True)
    assert [i for i, _, _ in back] == [2] and back[0][2]["TDX_BENCH_RETURNING"] == 1


def _steps(host, times_steps, ws, t0=100.0, pid=1):
    return [{"t": t0 + t, "event": "step", "host": host, "pid": pid, "step": s, "ws": ws, "rank": 0}
            for t, s in times_steps]


def test_metrics_of_a_restart_from_a_checkpoint_and_of_a_returning_node():
    """Steps 1-10 at width 3, the kill at t=10.5, a restart that resumes from step 8 at t=40 (9 and
    10 redone) at width 2, the returning host started at t=50, its first step at t=60 at width 3."""
    before = [(s, s) for s in range(1, 11)]
    events = (_steps("hostA", before, 3) + _steps("hostB", before, 3) + _steps("hostC", before, 3, pid=9)
              + _steps("hostA", [(40, 9), (41, 10), (42, 11)], 2, pid=2)
              + _steps("hostB", [(40.5, 9), (41, 10), (42, 11)], 2, pid=3)
              + _steps("hostC", [(60, 12), (61, 13)], 3, pid=10) + _steps("hostA", [(60, 12)], 3, pid=4))
    m = recovery_metrics(sorted(events, key=lambda e: e["t"]), "hostC", kill_t=110.5, rejoin_t=150.0)
    assert m["kill_step"] == 10 and m["steps_redone"] == 2
    assert m["recovery_s"] == pytest.approx(30.0) and (m["ws_before"], m["ws_after"]) == (3, 2)
    assert m["rejoin_s"] == pytest.approx(10.0) and m["ws_rejoined"] == 3 and m["rejoin_full_s"] == pytest.approx(10.0)
    assert m["final_step"] == 13


def test_metrics_without_a_returning_node_and_without_recovery():
    events = _steps("hostA", [(1, 1), (2, 2)], 2) + _steps("hostB", [(1, 1), (2, 2)], 2)
    m = recovery_metrics(events, "hostB", kill_t=102.5)
    assert (m["recovery_s"], m["ws_after"], m["rejoin_s"], m["steps_redone"]) == (None, None, None, 0)


def test_ours_returning_node_runs_the_first_start_command_again_on_the_victim_host(tmp_path):
    """The returning node of ours is the same ``torchdist_ext.run --keep-survivors`` command on the
    killed host (it joins the running job through the store in etcd), marked returning."""
    args = parse_args([])
    endpoint = "10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379"
    first = commands(args, "ours", NAMES, str(tmp_path), endpoint)
    back = commands(args, "ours", NAMES, str(tmp_path), endpoint, returning=True)
    assert [i for i, _, _ in back] == [2] and back[0][2]["TDX_BENCH_RETURNING"] == 1
    strip_logs = lambda argv: [a for a in argv if "agent-" not in a]  # noqa: E731 - its own log folder
    assert strip_logs(back[0][1]) == strip_logs(first[2][1])
    assert {"--keep-survivors", "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={endpoint}"} <= _flags(back[0][1])


def _run_worker(tmp_path, framework, steps_list, extra=()):
    """Runs one rank of the worker (no test hosts) once per entry of steps_list; its events by time."""
    out = tmp_path / "log"
    out.mkdir(exist_ok=True)
    (out / "go").touch()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), RANK="0",
               LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OMP_NUM_THREADS="1")
    for steps in steps_list:
        argv = [sys.executable, "-m", "torchdist_ext.bench._recovery_worker", "--framework", framework, "--out",
                str(out), "--examples", os.path.join(ROOT, "examples"), "--steps", str(steps), "--kill-step", "1",
                "--victim", "no-such-host", "--batch", "8", *extra]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return sorted((json.loads(line) for p in out.glob("*.jsonl") for line in p.read_text().splitlines()),
                  key=lambda e: e["t"])


def test_the_ours_worker_trains_one_rank_with_rejoin_on(tmp_path):
    """One rank of ours (ElasticDDP with rejoin=True, a first start: nothing joined): its steps are
    the trainer's step count, 1 to --steps, at world size 1."""
    events = _run_worker(tmp_path, "ours", [3])
    assert [e["event"] for e in events] == ["start", "ready", "step", "step", "step", "done"]
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2, 3]
    assert events[1]["resumed_at"] == 0 and all(e["ws"] == 1 for e in events if e["event"] == "step")


def test_the_worker_trains_logs_and_checkpoints_one_rank(tmp_path):
    """One rank of the torchrun variant (no test hosts): it logs start, ready and every step with its
    world size, checkpoints each step, and a second start resumes from the checkpoint."""
    ckpt = tmp_path / "ckpt.pt"
    events = _run_worker(tmp_path, "torchrun", [3, 5], extra=["--ckpt", str(ckpt)])
    kinds = [e["event"] for e in events]
    assert kinds == ["start", "ready", "step", "step", "step", "done", "start", "ready", "step", "step", "done"]
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2, 3, 4, 5]
    assert [e["resumed_at"] for e in events if e["event"] == "ready"] == [0, 3]
    assert all(e["ws"] == 1 for e in events if e["event"] == "step")


def test_plot_draws_one_column_a_framework(tmp_path):
    events = _steps("hostA", [(1, 1), (2, 2), (8, 3)], 2) + _steps("hostB", [(1, 1), (2, 2)], 2, pid=7)
    runs = [{"framework": fw, "kill_t": 102.5, "rejoin_t": None, "victim": "hostB", "events": events,
             "metrics": recovery_metrics(events, "hostB", 102.5)} for fw in ("ours", "torchrun")]
    from torchdist_ext.bench.recovery import plot

    plot(runs, str(tmp_path / "r.png"))
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_returning_node_that_only_trains_alone_is_not_counted_as_back():
    """The survivors finish at step 12; the returning host then takes steps 13-14 alone (width 1)."""
    events = (_steps("hostA", [(1, 1), (2, 2), (8, 11), (9, 12)], 2) + _steps("hostB", [(1, 1), (2, 2)], 2, pid=7)
              + _steps("hostB", [(20, 13), (21, 14)], 1, pid=8))
    m = recovery_metrics(events, "hostB", kill_t=102.5, rejoin_t=110.0)
    assert m["returned_alone"] and (m["rejoin_s"], m["ws_rejoined"], m["rejoin_full_s"]) == (None, None, None)


def test_joiner_timeline_reads_the_joined_and_admission_records():
    events = [{"t": 101.0, "event": "start", "host": "hostC", "pid": 9},
              {"t": 104.2, "event": "joined", "host": "hostC", "pid": 9, "announce_t": 103.5, "admitted_t": 103.9,
               "group_t": 104.0},
              {"t": 104.1, "event": "admission", "host": "hostA", "pid": 1, "step": 71, "seconds": 0.25,
               "reform_seconds": 0.2, "state_seconds": 0.05}]
    line = joiner_timeline(events, "hostC", rejoin_t=100.0)
    for words in ("process 1.00 s", "announced 3.50 s", "admitted 3.90 s", "group 4.00 s", "at step 71: 0.25 s",
                  "re-form 0.20 s", "state 0.05 s"):
        assert words in line, (words, line)
    assert joiner_timeline(events[:1], "hostC", rejoin_t=100.0) == ""
