"""torchdist_ext.ps: roles, sharding, consistency rules, and training against references."""
import pytest
import torch

from _dist import RankFailure, run_ranks
from _ps_models import accuracy, digits, global_batches, mlp
from torchdist_ext import ps
from torchdist_ext.ps._clocks import Clocks
from torchdist_ext.ps._layout import ShardPlan, describe, explain_mismatch

STEPS, BATCH = 12, 16


# ---- without processes ------------------------------------------------------------------------

def test_config_rejects_bad_roles_and_modes():
    with pytest.raises(ValueError, match="at least one server"):
        ps.PSConfig(num_servers=0)
    with pytest.raises(ValueError, match="world_size=2 ranks, so every rank would serve"):
        ps.PSConfig(num_servers=2).worker_ranks(2)
    with pytest.raises(ValueError, match="mode='bsp' is not one of sync, async, ssp"):
        ps.PSConfig(mode="bsp")
    with pytest.raises(ValueError, match="staleness=2 applies to mode='ssp' only"):
        ps.PSConfig(mode="async", staleness=2)
    cfg = ps.PSConfig(num_servers=2)
    assert cfg.server_ranks(5) == [0, 1] and cfg.worker_ranks(5) == [2, 3, 4]
    assert ps.PSConfig(mode="ssp", staleness=0).effective_mode == "sync"


def test_config_reads_server_count_from_environment(monkeypatch):
    monkeypatch.setenv("TDX_PS_SERVERS", "3")
    assert ps.PSConfig().num_servers == 3
    monkeypatch.setenv("TDX_PS_SERVERS", "two")
    with pytest.raises(ValueError, match="TDX_PS_SERVERS='two'"):
        ps.PSConfig()


def test_shards_are_balanced_by_bytes_and_views_cover_them():
    named = [(f"p{i}", torch.zeros(n)) for i, n in enumerate([100, 10, 60, 50, 5])]
    plan = ShardPlan(named, 2, "test")
    # largest first to the lighter server: 100 | 60, 50 | then 10 and 5 (a tie goes to server 0)
    assert plan.numels == [115, 110] and [[pc.index for pc in plan.pieces[k]] for k in (0, 1)] == [[0, 1, 4], [2, 3]]
    views = plan.views(torch.arange(110.0), 1)
    assert [v.numel() for v in views] == [60, 50] and views[1][0].item() == 60.0
    # split_bytes: the 100-element (400-byte) parameter as 10 rows split 3/3/4, the others whole
    split = ShardPlan([("big", torch.zeros(10, 10)), *named[1:]], 3, "test", split_bytes=400)
    assert [[(pc.index, pc.rows) for pc in split.pieces[k]] for k in range(3)] == \
        [[(0, (0, 3)), (2, None)], [(0, (3, 6)), (3, None)], [(0, (6, 10)), (1, None), (4, None)]]
    assert split.numels == [90, 80, 55] and split.views(torch.arange(55.0), 2)[0].shape == (4, 10)
    with pytest.raises(ValueError, match="split_bytes=0 must be None or an integer >= 1"):
        ps.PSConfig(split_bytes=0)
    with pytest.raises(ValueError, match=r"p0 \(torch.float64\) are not float32"):
        ShardPlan([("p0", torch.zeros(2, dtype=torch.float64))], 1, "test")


def test_layout_mismatch_is_explained():
    a, b = mlp(width=32), mlp(width=16)
    pa, pb = ShardPlan(list(a.named_parameters()), 1, "a"), ShardPlan(list(b.named_parameters()), 1, "b")
    why = explain_mismatch(describe(pa, [1, 0, 0, -1, 0]), describe(pb, [1, 0, 0, -1, 0]), "worker rank 2",
                           "server rank 0", pa.names)
    assert why == "parameter 0 (0.weight) has shape [32, 8] on worker rank 2 but [16, 8] on server rank 0"
    why = explain_mismatch(describe(pa, [1, 0, 0, -1, 0]), describe(pa, [1, 2, 3, 64, 0]), "w", "s")
    assert "staleness 0 vs 3" in why and "mode 0 vs 2" in why and "split_bytes -1 vs 64" in why
    assert explain_mismatch(describe(pa, [1, 0, 0, -1, 0]), describe(pa, [1, 0, 0, -1, 0]), "w", "s") == ""
    sparse = ShardPlan(list(a.named_parameters()), 1, "a", sparse=["0.weight"])
    why = explain_mismatch(describe(pa, [1, 0, 0, -1, 0]), describe(sparse, [1, 0, 0, -1, 0]), "w", "s", pa.names)
    assert why == "parameter 0 (0.weight) has shape [32, 8] on w but [32, 8] (sparse) on s"


def test_clocks_ssp_releases_within_the_bound():
    c = Clocks([2, 3], "ssp", 1)
    assert c.push(2, 0) and c.release() == [2]      # 1 ahead of rank 3: allowed
    assert c.push(2, 1) and c.release() == []       # 2 ahead: waits
    assert c.push(3, 0) and c.release() == [2, 3]   # the slowest moved: both go
    assert c.staleness == {0: 2, 1: 1}
    assert c.push(2, 2) and c.release() == []       # clock 3 vs slowest 1
    assert not c.remove(3) and c.release() == [2]   # a lost straggler no longer holds anyone back
    with pytest.raises(RuntimeError, match="pushed at clock 7 but the server has taken 3"):
        c.push(2, 7)


def test_clocks_sync_steps_once_every_live_worker_pushed():
    c = Clocks([2, 3, 4], "sync", 0)
    assert not c.push(2, 0) and not c.push(4, 0) and c.release() == []
    assert c.remove(3)                              # the missing worker died: the step completes
    assert c.take_pending() == 2 and c.release() == [2, 4]


# ---- with processes ---------------------------------------------------------------------------

def _partly_frozen(seed=0):
    """The MLP with its first bias frozen: servers must leave it as it is (with weight decay, a step
    on a zero gradient would move it)."""
    net = mlp(seed=seed)
    net[0].bias.requires_grad_(False)
    return net


def _sync_vs_ddp(rank, world_size):
    import torch.distributed as dist

    import torchdist_ext

    cfg = ps.PSConfig(num_servers=2, mode="sync")
    batches = global_batches(STEPS, BATCH)
    n_workers, out = world_size - cfg.num_servers, {}
    if ps.is_server(cfg):
        server = ps.ParameterServer(_partly_frozen(), torch.optim.Adam, cfg, lr=0.01, weight_decay=0.05)
        stats = server.run()
        out = {"stats": stats, "shard": {n: p.detach().clone() for n, p in server.named_parameters()}}
    else:
        i = rank - cfg.num_servers
        model = ps.Worker(_partly_frozen(seed=rank), cfg)  # other initial values: the pull replaces them
        opt = ps.PushOptimizer(model)
        for x, y in batches:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x.chunk(n_workers)[i]), y.chunk(n_workers)[i]).backward()
            opt.step()
        model.close()
        out["ps"] = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    group = dist.new_group(cfg.worker_ranks(world_size))  # every rank takes part in new_group
    if not ps.is_server(cfg):
        ddp = torchdist_ext.DistributedDataParallel(_partly_frozen(), process_group=group)
        opt = torch.optim.Adam(ddp.parameters(), lr=0.01, weight_decay=0.05)
        for x, y in batches:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x.chunk(n_workers)[i]), y.chunk(n_workers)[i]).backward()
            opt.step()
        out["ddp"] = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    return out


def _stage_last_worker(rank):
    return {"TDX_PS_STAGE": "1"} if rank == 3 else {}  # rank 3 takes the staged (CUDA worker) path on the CPU


def test_sync_equals_single_process_training_and_ddp():
    results = run_ranks(_sync_vs_ddp, 4, rank_env=_stage_last_worker)
    ref = _partly_frozen()
    opt = torch.optim.Adam(ref.parameters(), lr=0.01, weight_decay=0.05)
    for x, y in global_batches(STEPS, BATCH):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    expected = dict(ref.named_parameters())
    torch.testing.assert_close(expected["0.bias"], mlp()[0].bias, rtol=0, atol=0)  # frozen: untouched
    held = {}
    for r in (0, 1):
        assert results[r]["stats"].updates == STEPS and sorted(results[r]["stats"].finished) == [2, 3]
        assert set(results[r]["stats"].staleness) == {0}
        held.update(results[r]["shard"])
    assert sorted(held) == sorted(expected)
    assert len(results[0]["shard"]) and len(results[1]["shard"])  # both servers hold a shard
    for name, want in expected.items():
        torch.testing.assert_close(held[name], want.detach(), rtol=1e-5, atol=1e-6)
        for r in (2, 3):
            torch.testing.assert_close(results[r]["ps"][name], want.detach(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(results[r]["ddp"][name], results[r]["ps"][name], rtol=1e-5, atol=1e-6)


DIGIT_MODES = [("sync", 0), ("async", 0), ("ssp", 2)]
EPOCHS, DIGIT_BATCH, STRAGGLER_SLEEP = 12, 32, 0.004


def _digits_net():
    return mlp(seed=0, width=64, d_in=64, d_out=10)


def _train_digits(rank, world_size):
    import time

    (x, y), _ = digits()
    out = []
    for mode, s in DIGIT_MODES:
        cfg = ps.PSConfig(num_servers=1, mode=mode, staleness=s)
        if ps.is_server(cfg):
            server = ps.ParameterServer(_digits_net(), torch.optim.SGD, cfg, lr=0.05, momentum=0.9)
            stats = server.run()
            out.append({"stats": stats, "params": {n: p.detach().clone() for n, p in server.named_parameters()}})
            continue
        i, n = rank - 1, world_size - 1
        xs, ys = x[i::n], y[i::n]
        model, max_gap = ps.Worker(_digits_net(), cfg), 0
        opt = ps.PushOptimizer(model)
        g = torch.Generator().manual_seed(rank)
        for _ in range(EPOCHS):
            perm = torch.randperm(len(xs), generator=g)
            for b in range(0, len(xs), DIGIT_BATCH):
                idx = perm[b:b + DIGIT_BATCH]
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(xs[idx]), ys[idx]).backward()
                if rank == 1:
                    time.sleep(STRAGGLER_SLEEP)  # a straggler, so staleness is exercised
                opt.step()
                max_gap = max(max_gap, model.clock - model.server_info[0][2])  # my clock - the slowest's
        model.close()
        out.append({"max_gap": max_gap, "steps": model.clock})
    return out


def test_async_and_ssp_converge_on_digits_with_bounded_staleness():
    results = run_ranks(_train_digits, 3)
    _, (x_test, y_test) = digits()
    acc = {}
    for m, (mode, s) in enumerate(DIGIT_MODES):
        net = _digits_net()
        net.load_state_dict(results[0][m]["params"])
        acc[mode] = accuracy(net, x_test, y_test)
        hist = results[0][m]["stats"].staleness
        gaps = [results[r][m]["max_gap"] for r in (1, 2)]
        print(f"{mode}(s={s}): accuracy {acc[mode]:.2f}%, staleness histogram {hist}, worker-side max gap {gaps}")
        assert results[0][m]["stats"].pushes == sum(results[r][m]["steps"] for r in (1, 2))
        if mode == "sync":
            assert set(hist) == {0} and gaps == [0, 0]
        if mode == "ssp":
            assert max(hist) <= s and max(gaps) <= s
    assert max(results[0][1]["stats"].staleness) > 2  # the instrumentation does see staleness (async)
    assert acc["sync"] > 90.0, acc
    for mode in ("async", "ssp"):
        assert abs(acc[mode] - acc["sync"]) <= 1.0, acc


def _bad_input(rank, world_size):
    with pytest.raises(ValueError, match="every rank would serve and none would train"):
        ps.is_server(ps.PSConfig(num_servers=world_size))
    cfg = ps.PSConfig(num_servers=1)
    if ps.is_server(cfg):
        with pytest.raises(ValueError, match="is a server"):
            ps.Worker(mlp(), cfg)
        ps.serve(mlp(), torch.optim.SGD, cfg, lr=0.1)
    else:
        bag = torch.nn.ModuleDict({"bag": torch.nn.EmbeddingBag(9, 2, sparse=True)})
        with pytest.raises(ValueError, match=r"bag are nn.EmbeddingBag\(sparse=True\)"):
            ps.Worker(bag, cfg)
        ps.Worker(mlp(width=16 if rank == 2 else 32), cfg)


def test_bad_input_gives_clear_errors():
    out = run_ranks(_bad_input, 3, expect_failure_ranks=[0, 1, 2])
    assert out[2][0] == "error" and ("ValueError: ps.Worker: this worker's model does not match the servers' "
                                     "layout: parameter 0 (0.weight) has shape [16, 8] on worker rank 2 but "
                                     "[32, 8] on server rank 0") in out[2][1]
    assert out[0][0] == "error" and "parameter 0 (0.weight) has shape [32, 8] on server rank 0 but [16, 8] on " \
                                    "worker rank 2" in out[0][1]
    # the matching worker learns that the server stopped, by name
    assert out[1][0] == "error" and "ServerFailedError: ps.Worker rank 1: parameter server rank 0 failed" in out[1][1]
