"""torchdist_ext.ps with replicated shards: a server dies, its replica takes over, no update is lost."""
import os
import time
import warnings

import pytest
import torch

from _dist import run_ranks
from _ps_models import FailingSGD, global_batches, mlp
from torchdist_ext import ps
from torchdist_ext.ps._protocol import APPLIED, HEADER, UPDATES, counters, lr_word
from torchdist_ext.ps._replicas import holders

STEPS, KILL_AT, BATCH = 16, 6, 8


def test_replicas_sit_on_another_server_and_host():
    assert holders(["a", "a"]) == [1, 0]                 # one host: the previous server on the ring
    assert holders(["a", "a", "a"]) == [2, 0, 1]
    nodes = ["a", "a", "b", "b"]                         # servers 0-1 on host a, 2-3 on host b
    for shard, holder in enumerate(holders(nodes)):
        assert holder != shard and nodes[holder] != nodes[shard]
    with pytest.raises(ValueError, match="replicate=True keeps each shard's replica on another server, but "
                                         "num_servers=1"):
        ps.PSConfig(num_servers=1, replicate=True)


def test_replicate_reads_the_environment(monkeypatch):
    monkeypatch.setenv("TDX_PS_REPLICATE", "1")
    assert ps.PSConfig(num_servers=2).replicate is True
    monkeypatch.setenv("TDX_PS_REPLICATE", "yes")
    with pytest.raises(ValueError, match="TDX_PS_REPLICATE='yes' must be 1"):
        ps.PSConfig(num_servers=2)


def test_reply_counters_are_exact_int64():
    buf = torch.zeros(HEADER + 4)
    counters(buf)[UPDATES], counters(buf)[APPLIED] = 2 ** 24 + 1, 2 ** 53 + 1
    lr_word(buf)[0] = 0.1
    assert int(counters(buf)[UPDATES]) == 2 ** 24 + 1 and int(counters(buf)[APPLIED]) == 2 ** 53 + 1
    assert lr_word(buf).item() == 0.1
    assert torch.tensor(2 ** 24 + 1, dtype=torch.float32).item() != 2 ** 24 + 1  # what a float32 word held


def _job(rank, world_size, mode, fail, done=None):
    """2 servers (replicated) and 2 workers; server rank 1 fails at its KILL_AT-th step if ``fail``:
    SIGKILLed ("kill"), or its optimizer raises ("raise") and the process stays alive until the
    workers are done (files ``done``-rank), so only the FAILED replies can tell them."""
    cfg = ps.PSConfig(num_servers=2, mode=mode, staleness=1 if mode == "ssp" else 0, replicate=True)
    if ps.is_server(cfg):
        fail_at = KILL_AT if fail and rank == 1 else 10 ** 9
        try:
            return ps.serve(mlp(), FailingSGD, cfg, lr=0.1, momentum=0.9, fail_at=fail_at, how=fail or "kill")
        except RuntimeError as e:
            deadline = time.monotonic() + 120
            while not all(os.path.exists(f"{done}-{w}") for w in (2, 3)) and time.monotonic() < deadline:
                time.sleep(0.05)
            return f"raised: {e}"
    model = ps.Worker(mlp(seed=rank), cfg)  # other initial values: the pull replaces them
    opt = ps.PushOptimizer(model)
    i = rank - cfg.num_servers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in global_batches(STEPS, BATCH):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x.chunk(2)[i]), y.chunk(2)[i]).backward()
            opt.step()
    model.close()
    if done:
        open(f"{done}-{rank}", "w").close()
    return {"params": [p.detach().clone() for p in model.parameters()], "acked": model.acked,
            "failovers": model.failovers, "warned": [str(w.message) for w in caught], "info": model.server_info}


def _two_hosts(rank):
    return {"TDX_NODE_ID": f"simhost{rank % 2}"}  # servers 0 and 1 on two hosts, a worker on each


def _survivors(out):
    """Per shard, the ServerStats of the copy that served it to the end (server 0's own or its replica)."""
    status, stats = out[0]
    assert status == "ok", out[0]
    assert stats.shard == 0 and stats.replica.shard == 1
    return {0: stats, 1: stats.replica}


def _check_no_update_lost(out, expected_applied):
    survivors = _survivors(out)
    for k, stats in survivors.items():
        acked = sum(out[w][1]["acked"][k] for w in (2, 3))
        assert acked == stats.applied == expected_applied, (k, acked, stats)
    for w in (2, 3):
        status, got = out[w]
        assert status == "ok", out[w]
        assert [f[:3] for f in got["failovers"]] == [(1, 1, 0)], got["failovers"]  # shard 1: server 1 -> 0
        assert any("parameter server rank 1 failed" in m and "goes on on its replica on server rank 0" in m
                   for m in got["warned"]), got["warned"]
        assert any("held the replica of shard 0" in m for m in got["warned"]), got["warned"]


def test_sync_server_killed_equals_the_run_without_death():
    ref = run_ranks(_job, 4, "sync", None)
    out = run_ranks(_job, 4, "sync", "kill", expect_failure_ranks=[1])
    assert out[1][0] == "died"
    _check_no_update_lost(out, 2 * STEPS)  # every push of both workers, on the copy that survived
    for w in (2, 3):  # the last replies' counters: STEPS updates per shard, 2 live workers, slowest at STEPS
        assert out[w][1]["info"] == ref[w]["info"] == [(STEPS, 2, STEPS)] * 2
    for w in (2, 3):
        for a, b in zip(out[w][1]["params"], ref[w]["params"]):
            assert torch.equal(a, b)  # bit for bit: the replica applied what its server would have
    assert ref[0].applied == ref[0].replica.applied == ref[1].applied == 2 * STEPS


def test_async_server_raises_workers_go_on_with_every_update(tmp_path):
    out = run_ranks(_job, 4, "async", "raise", str(tmp_path / "done"))
    out = {r: ("ok", v) for r, v in enumerate(out)}
    assert out[1][1] == "raised: injected optimizer failure"  # its process lived on until the workers were done
    _check_no_update_lost(out, 2 * STEPS)
    for w in (2, 3):
        assert any("its serving loop raised an exception" in m for m in out[w][1]["warned"]), out[w][1]["warned"]
    assert _survivors(out)[1].updates == 2 * STEPS  # async: one update per push, as without the failure


def test_ssp_across_hosts_server_killed():
    out = run_ranks(_job, 4, "ssp", "kill", rank_env=_two_hosts, expect_failure_ranks=[1])
    assert out[1][0] == "died"
    _check_no_update_lost(out, 2 * STEPS)
    assert _survivors(out)[1].updates == 2 * STEPS


def test_server_killed_on_real_hosts_its_replica_on_the_other_host_takes_over(tmp_path):
    """2 test hosts (network namespaces): server 0 and worker 2 on hostA, server 1 and worker 3 on
    hostB, so each shard's replica sits on the other host; server 1 is SIGKILLed mid-run (async), its
    shard goes on from the replica on hostA and no update is lost; nothing is left in /dev/shm."""
    from _testhosts import TestHosts
    from _testhosts import unavailable_reason as hosts_unavailable
    from test_elastic_hosts import _collect, _start

    reason = hosts_unavailable()
    if reason:
        pytest.skip(reason)
    with TestHosts(2) as hosts:
        out, procs = _start(hosts, tmp_path, "test_ps_replicas:_job", "async", "kill", host_of=lambda r: r % 2)
        results = _collect(hosts, tmp_path, out, procs, victim=1)
        names = [h.name for h in hosts.hosts]
    assert [results[r]["host"] for r in (0, 2, 3)] == [names[0], names[0], names[1]]
    out = {r: ("ok", results[r]["result"]) for r in (0, 2, 3)}
    _check_no_update_lost(out, 2 * STEPS)
    assert _survivors(out)[1].updates == 2 * STEPS
