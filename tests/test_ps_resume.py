"""torchdist_ext.ps: a learning-rate schedule driven from the workers, a parameter split by rows across
servers, and ps.save / ps.load resumed with other server and worker counts, against one process."""
import pytest
import torch

from _dist import run_ranks
from _ps_models import global_batches, mlp
from torchdist_ext import ps

STEPS, HALF, BATCH = 12, 6, 16
SPLIT = 2048  # bytes: the 32x32 hidden weight (4 KB) is split by rows, the rest is assigned whole


def _optimizer(params):
    return torch.optim.Adam(params, lr=0.02, weight_decay=0.01)


def _schedule(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _train_part(rank, world_size, num_servers, mode, steps, path, sched_path, resume):
    cfg = ps.PSConfig(num_servers=num_servers, mode=mode, split_bytes=SPLIT)
    if ps.is_server(cfg):
        server = ps.ParameterServer(mlp(), torch.optim.Adam, cfg, lr=0.02, weight_decay=0.01)
        if resume:
            bad = dict(ps.load(path), params={"0.weight": torch.zeros(3)})
            with pytest.raises(ValueError, match=r"missing \['0.bias'"):
                server.load_state_dict(bad)
            server.load_state_dict(ps.load(path))
        stats = server.run()
        return {"stats": stats, "shard": {n: p.detach().clone() for n, p in server.named_parameters()},
                "lr": server.optimizer.param_groups[0]["lr"]}
    workers = cfg.worker_ranks(world_size)
    i, n = workers.index(rank), len(workers)
    model = ps.Worker(mlp(seed=rank), cfg)
    opt = ps.PushOptimizer(model)
    sched = _schedule(opt)
    if resume:  # the worker side of a torch checkpoint: the optimizer (its lr) and the scheduler
        saved = torch.load(sched_path)
        opt.load_state_dict(saved["opt"])
        sched.load_state_dict(saved["sched"])
    for x, y in global_batches(STEPS, BATCH)[steps]:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x.chunk(n)[i]), y.chunk(n)[i]).backward()
        opt.step()
        sched.step()
    if not resume and i == 0:
        ps.save(model, path)
        torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, sched_path)
    model.close()
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def _stage_rank3(rank):
    return {"TDX_PS_STAGE": "1"} if rank == 3 else {}  # the staged (CUDA worker) path, on the CPU


def test_schedule_split_and_resume_at_other_server_and_worker_counts(tmp_path):
    path, sched_path = str(tmp_path / "ps.pt"), str(tmp_path / "sched.pt")
    # 2 servers (the hidden weight split by rows between them) and 2 workers for the first half ...
    first = run_ranks(_train_part, 4, 2, "sync", slice(0, HALF), path, sched_path, False, rank_env=_stage_rank3)
    # ... then 3 servers (its rows split three ways) and 1 worker resume from the file, under "async"
    # (one worker: each push applied on arrival with the rate it carries, as one process would), with
    # replicated shards ($TDX_PS_REPLICATE): each server also loads the replica it holds
    second = run_ranks(_train_part, 4, 3, "async", slice(HALF, STEPS), path, sched_path, True,
                       env={"TDX_PS_REPLICATE": "1"})

    ref = mlp()
    opt = _optimizer(ref.parameters())
    sched = _schedule(opt)
    lrs, mid = [], None
    for step, (x, y) in enumerate(global_batches(STEPS, BATCH)):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        if step == HALF - 1:
            mid = {n: p.detach().clone() for n, p in ref.named_parameters()}
    assert len(set(lrs)) == STEPS // 2  # the schedule changes the rate every 2 steps

    assert sorted(n for r in (0, 1) for n in first[r]["shard"] if n.startswith("2.weight")) == \
        ["2.weight[0:16]", "2.weight[16:32]"]
    assert sorted(n for r in (0, 1, 2) for n in second[r]["shard"] if n.startswith("2.weight")) == \
        ["2.weight[0:10]", "2.weight[10:21]", "2.weight[21:32]"]
    saved = ps.load(path)
    assert saved["updates"] == HALF and saved["param_groups"][0]["lr"] == lrs[HALF - 1]
    assert set(saved["optimizer_state"]["2.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    for r in (0, 1):
        assert first[r]["stats"].updates == HALF and sorted(first[r]["stats"].finished) == [2, 3]
    for r in (0, 1, 2):
        assert second[r]["stats"].updates == STEPS and second[r]["stats"].finished == [3]
        assert second[r]["stats"].replica.updates == STEPS and second[r]["stats"].replica.applied == HALF
        assert second[r]["lr"] == lrs[-1]  # the servers ran the workers' schedule, exactly
    for name, want in mid.items():
        torch.testing.assert_close(saved["params"][name], want, rtol=1e-5, atol=1e-6)
        for r in (2, 3):
            torch.testing.assert_close(first[r][name], want, rtol=1e-5, atol=1e-6)
    for name, want in ref.named_parameters():
        torch.testing.assert_close(second[3][name], want.detach(), rtol=1e-5, atol=1e-6)
