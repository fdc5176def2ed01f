"""torchdist_ext.ps when a node fails: a lost worker is dropped and reported, a lost server named."""
import os
import signal
import time

import torch

from _dist import run_ranks
from _ps_models import FailingSGD, global_batches, mlp
from torchdist_ext import ps

STEPS, KILL_AT = 20, 6


def _train(model, rank, kill_at=None):
    opt = ps.PushOptimizer(model)
    for step, (x, y) in enumerate(global_batches(STEPS, 8, seed=rank)):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # dies between its backward and its push
        opt.step()


def _worker_dies(rank, world_size):
    import warnings

    cfg = ps.PSConfig(num_servers=2, mode="sync")
    if ps.is_server(cfg):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stats = ps.serve(mlp(), torch.optim.SGD, cfg, lr=0.1)
        return stats, [str(w.message) for w in caught]
    model = ps.Worker(mlp(), cfg)
    _train(model, rank, kill_at=KILL_AT if rank == 3 else None)
    model.close()
    return model.clock


def test_killed_worker_does_not_stop_the_job():
    out = run_ranks(_worker_dies, 4, expect_failure_ranks=[3])
    assert out[3][0] == "died"
    assert out[2] == ("ok", STEPS)  # the other worker trained to the end
    for r in (0, 1):
        status, (stats, warned) = out[r]
        assert status == "ok" and stats.finished == [2] and list(stats.lost) == [3]
        assert "rank 3" in stats.lost[3] and "exited" in stats.lost[3]
        assert any("worker rank 3 was lost; training goes on without it" in w for w in warned)
        assert stats.updates == STEPS  # sync steps went on with the surviving worker


def _server_dies(rank, world_size, stamp):
    cfg = ps.PSConfig(num_servers=2, mode="ssp", staleness=1)
    if ps.is_server(cfg):
        die_at = KILL_AT if rank == 1 else 10 ** 9
        return ps.serve(mlp(), FailingSGD, cfg, lr=0.1, fail_at=die_at, stamp=stamp)
    model = ps.Worker(mlp(), cfg)
    try:
        _train(model, rank)
    except ps.ServerFailedError as e:
        with open(stamp) as f:
            return e.server_rank, str(e), time.time() - float(f.read())
    return None


def test_killed_server_is_named_by_every_worker(tmp_path):
    out = run_ranks(_server_dies, 4, str(tmp_path / "stamp"), expect_failure_ranks=[1])
    assert out[1][0] == "died"
    for r in (2, 3):
        status, got = out[r]
        assert status == "ok" and got is not None, out[r]
        server, msg, delay = got
        assert server == 1 and "parameter server rank 1 failed" in msg and "rank 1 (pid" in msg, msg
        print(f"worker rank {r} raised {delay:.3f} s after server rank 1 died: {msg}")
    status, stats = out[0]
    assert status == "ok" and sorted(stats.lost) == [2, 3]  # the surviving server stops once its workers are gone


def _two_hosts(rank):
    return {"TDX_NODE_ID": f"simhost{rank // 2}"}  # ranks 0-1 on one simulated host, 2-3 on another


def _across_hosts(rank, world_size):
    cfg = ps.PSConfig(num_servers=1, mode="sync")
    if ps.is_server(cfg):
        return ps.serve(mlp(), torch.optim.SGD, cfg, lr=0.1)
    model = ps.Worker(mlp(), cfg)
    _train(model, rank, kill_at=KILL_AT if rank == 2 else None)
    model.close()
    return model.clock


def test_across_hosts_a_killed_worker_is_dropped():
    """Between hosts tdx's p2p is Gloo's (its Work has no future: the server waits in threads)."""
    out = run_ranks(_across_hosts, 4, rank_env=_two_hosts, expect_failure_ranks=[2])
    assert out[2][0] == "died" and out[1] == ("ok", STEPS) and out[3] == ("ok", STEPS)
    status, stats = out[0]
    assert status == "ok" and sorted(stats.finished) == [1, 3] and list(stats.lost) == [2]
    assert stats.updates == STEPS


def _server_raises(rank, world_size):
    """2 replicated async servers, 2 workers; server rank 1's optimizer raises at its 4th step and the
    exception leaves the rank (no destroy_process_group: its group is still alive at exit, its
    receives still posted); the workers go on on the replica."""
    cfg = ps.PSConfig(num_servers=2, mode="async", replicate=True)
    if ps.is_server(cfg):
        return ps.serve(mlp(), FailingSGD, cfg, lr=0.1, fail_at=4 if rank == 1 else 10 ** 9, how="raise")
    model = ps.Worker(mlp(seed=rank), cfg)
    _train(model, rank)
    model.close()
    return model.clock


def test_a_server_that_raises_exits_without_aborting_the_process(capfd):
    """Its process ends with the exception, not with "terminate called without an active exception":
    the group's threads are shut down at exit while the interpreter still runs (a thread that failed
    the posted receives during finalization used to abort the process)."""
    out = run_ranks(_server_raises, 4, expect_failure_ranks=[1])
    status, trace = out[1]
    assert status == "error" and "injected optimizer failure" in trace, out[1]
    assert out[2] == out[3] == ("ok", STEPS), out
    assert out[0][0] == "ok", out[0]
    err = capfd.readouterr().err
    assert "terminate called" not in err and "Aborted" not in err, err[-3000:]
