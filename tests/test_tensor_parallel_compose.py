"""Tensor parallelism composed and checked: vocab-parallel embedding + cross-entropy, TP-layout
checkpoints across degrees 2 -> 4 -> 1, dp x tp with our DDP, pp x tp with our pipeline, errors
before any communication, and torch's own DTensor parallelize_module on a tdx group."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from _dist import run_ranks
from _tp_models import MLP, Block, block_plan
import torchdist_ext
from torchdist_ext import tensor_parallel as tp

V, H = 16, 8


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.block, self.head = nn.Embedding(V, H), Block(H, 4, 16), nn.Linear(H, V)

    def forward(self, ids):
        return self.head(self.block(self.emb(ids)))


def _lm_data():
    torch.manual_seed(3)
    ids, tgt = torch.randint(0, V, (2, 6)), torch.randint(0, V, (2, 6))
    tgt[0, 0] = -100
    return ids, tgt


def _lm_plan():
    plan = {"emb": "vocab", "head": "vocab"}
    plan.update({k: v for k, v in block_plan("block.").items() if v != "sequence"})
    return plan


def _lm_rank(rank, ws):
    torch.manual_seed(0)
    m = tp.parallelize_module(LM(), None, _lm_plan())
    ids, tgt = _lm_data()
    loss = tp.vocab_parallel_cross_entropy(m(ids), tgt)
    loss.backward()
    return loss.detach(), {k: p.grad for k, p in m.state_dict(keep_vars=True).items()}, tp.tp_layout(m)


def test_vocab_parallel_embedding_and_cross_entropy():
    torch.manual_seed(0)
    ref = LM()
    ids, tgt = _lm_data()
    ref_loss = F.cross_entropy(ref(ids).flatten(0, 1), tgt.flatten())
    ref_loss.backward()
    out = run_ranks(_lm_rank, 4, timeout=120)
    merged = tp.merge_shards([o[1] for o in out], out[0][2])
    for o in out:
        torch.testing.assert_close(o[0], ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for k, p in ref.named_parameters():
        torch.testing.assert_close(merged[k], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")


def _sgd_step(m, ids, tgt, ws):
    m.zero_grad()
    loss = (tp.vocab_parallel_cross_entropy if ws else lambda a, b: F.cross_entropy(a.flatten(0, 1), b.flatten()))(m(ids), tgt)
    loss.backward()
    with torch.no_grad():
        for p in m.parameters():
            p -= 0.1 * p.grad
    return loss.detach()


def _ckpt_rank(rank, ws, full):
    torch.manual_seed(1 + ws)  # a different init: the loaded checkpoint must replace it
    m = tp.parallelize_module(LM(), None, _lm_plan())
    if full is not None:
        m.load_state_dict(tp.shard_state_dict(full, tp.tp_layout(m), ws, rank))
    ids, tgt = _lm_data()
    loss = _sgd_step(m, ids, tgt, ws)
    return loss, m.state_dict(), tp.tp_layout(m)


def test_checkpoint_across_tp_degrees_2_4_1():
    torch.manual_seed(0)
    ref = LM()
    start = {k: v.clone() for k, v in ref.state_dict().items()}
    ids, tgt = _lm_data()
    ref_losses = [_sgd_step(ref, ids, tgt, 0) for _ in range(2)]
    out2 = run_ranks(_ckpt_rank, 2, start, timeout=120)          # saved in TP=2 layout
    full2 = tp.merge_shards([o[1] for o in out2], out2[0][2])
    out4 = run_ranks(_ckpt_rank, 4, full2, timeout=120)          # loaded into TP=4, one more step
    full4 = tp.merge_shards([o[1] for o in out4], out4[0][2])
    torch.testing.assert_close(out2[0][0], ref_losses[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out4[0][0], ref_losses[1], rtol=1e-5, atol=1e-6)
    unsplit = LM()
    unsplit.load_state_dict(full4)                                 # and into the unsplit model (TP=1)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(unsplit.state_dict()[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def _train_ref(steps, lr=0.1):
    torch.manual_seed(0)
    m = Block()
    torch.manual_seed(5)
    xs, ts = torch.randn(steps, 4, 8, 16), torch.randn(steps, 4, 8, 16)
    for i in range(steps):
        m.zero_grad()
        F.mse_loss(m(xs[i]), ts[i]).backward()
        with torch.no_grad():
            for p in m.parameters():
                p -= lr * p.grad
    return m, xs, ts


def _dp_tp_rank(rank, ws, steps, wrapper):
    mesh = tp.init_mesh(dp=2, tp=2)
    torch.manual_seed(0)
    m = tp.parallelize_module(Block(), mesh, {k: v for k, v in block_plan().items() if v != "sequence"})
    if wrapper == "ddp":
        ddp = torchdist_ext.DistributedDataParallel(m, process_group=mesh.dp_group)
    else:  # ZeRO-1: optimizer state sharded over the data-parallel replicas
        ddp = torchdist_ext.FullyShardedDataParallel(m, stage=1, process_group=mesh.dp_group)
    torch.manual_seed(5)
    xs, ts = torch.randn(steps, 4, 8, 16), torch.randn(steps, 4, 8, 16)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    half = slice(2 * mesh.dp_rank, 2 * mesh.dp_rank + 2)
    for i in range(steps):
        opt.zero_grad()
        F.mse_loss(ddp(xs[i][half]), ts[i][half]).backward()
        opt.step()
    if wrapper == "ddp":
        sd = m.state_dict()
    else:  # collective over the dp group; every replica gets it
        from torchdist_ext.fsdp.state_dict import full_state_dict
        sd = full_state_dict(ddp, rank0_only=False)
    return mesh.dp_rank, mesh.tp_rank, sd, tp.tp_layout(m)


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp_stage1"])
def test_dp2_x_tp2_trains_to_single_process_parameters(wrapper):
    ref, _, _ = _train_ref(3)
    out = run_ranks(_dp_tp_rank, 4, 3, wrapper, timeout=150)
    for dp_rank in (0, 1):
        shards = [o[2] for o in sorted(out, key=lambda o: o[1]) if o[0] == dp_rank]
        full = tp.merge_shards(shards, out[0][3])
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(full[k], v, rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.b0, self.b1 = Block(), Block()

    def forward(self, x):
        return self.b1(self.b0(x))


def _pp_tp_rank(rank, ws, steps):
    from torchdist_ext.pipeline import PipelineStage, ScheduleGPipe
    mesh = tp.init_mesh(pp=2, tp=2)
    torch.manual_seed(0)
    full = _Two()
    stage_mod = getattr(full, f"b{mesh.pp_rank}")
    tp.parallelize_module(stage_mod, mesh, {k: v for k, v in block_plan().items() if v != "sequence"})
    stage = PipelineStage(stage_mod, mesh.pp_rank, 2, torch.device("cpu"), group=mesh.pp_group)
    sched = ScheduleGPipe(stage, 2, loss_fn=F.mse_loss)
    torch.manual_seed(5)
    xs, ts = torch.randn(steps, 4, 8, 16), torch.randn(steps, 4, 8, 16)
    opt = torch.optim.SGD(stage_mod.parameters(), lr=0.1)
    for i in range(steps):
        opt.zero_grad()
        if mesh.pp_rank == 0:
            sched.step(xs[i])
        else:
            sched.step(target=ts[i])
        opt.step()
    return mesh.pp_rank, mesh.tp_rank, stage_mod.state_dict(), tp.tp_layout(stage_mod)


def test_pp2_x_tp2_trains_to_single_process_parameters():
    torch.manual_seed(0)
    ref = _Two()
    torch.manual_seed(5)
    xs, ts = torch.randn(3, 4, 8, 16), torch.randn(3, 4, 8, 16)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(3):
        opt.zero_grad()
        # GPipe with 2 micro-batches averages the per-micro-batch mean losses.
        sum(F.mse_loss(ref(x), t) for x, t in zip(xs[i].chunk(2), ts[i].chunk(2))).div(2).backward()
        opt.step()
    out = run_ranks(_pp_tp_rank, 4, 3, timeout=150)
    for stage in (0, 1):
        shards = [o[2] for o in sorted(out, key=lambda o: o[1]) if o[0] == stage]
        full = tp.merge_shards(shards, out[0][3])
        for k, v in getattr(ref, f"b{stage}").state_dict().items():
            torch.testing.assert_close(full[k], v, rtol=1e-4, atol=1e-6, msg=lambda m: f"b{stage}.{k}: {m}")


def _errors_rank(rank, ws):
    msgs = []
    for make, plan in ((lambda: MLP(16, 30), {"fc1": "colwise", "fc2": "rowwise"}),   # 30 % 4
                       (lambda: Block(12, 2, 16), block_plan()),                      # 2 heads, TP 4
                       (lambda: MLP(), {"fc1": "colwise", "nope": "rowwise"}),
                       (lambda: MLP(), {"fc1": "diagonal"}),
                       (lambda: Block(), {"ln1": "sequence"})):
        try:
            tp.parallelize_module(make(), None, plan)
            msgs.append(None)
        except (ValueError, TypeError) as e:
            msgs.append(str(e))
    try:
        tp.init_mesh(dp=3, tp=2)
        msgs.append(None)
    except ValueError as e:
        msgs.append(str(e))
    return msgs


def test_bad_input_raises_before_any_communication():
    # A rank that communicated would wait for the others; every rank raising promptly shows none did.
    out = run_ranks(_errors_rank, 4, timeout=60, pg_timeout=20)
    for msgs in out:
        assert "fc1.out_features = 30 is not divisible by the tensor-parallel degree 4" in msgs[0]
        assert "n_heads = 2 is not divisible" in msgs[1]
        assert "['nope']" in msgs[2]
        assert "'diagonal'" in msgs[3]
        assert "pass sequence_parallel=True" in msgs[4]
        assert "dp*pp*tp = 3*1*2 = 6 but the world size is 4" in msgs[5]


def _dtensor_rank(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize
    assert dist.get_backend() == "tdx"
    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    m = torch_parallelize(MLP(), mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    torch.manual_seed(1)
    x, t = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    loss = F.mse_loss(m(x), t)
    loss.backward()
    return loss.detach(), m.fc1.weight.grad.full_tensor(), m.fc2.weight.grad.full_tensor()


def test_torch_dtensor_parallelize_module_on_tdx():
    torch.manual_seed(0)
    ref = MLP()
    torch.manual_seed(1)
    x, t = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    loss = F.mse_loss(ref(x), t)
    loss.backward()
    for l, g1, g2 in run_ranks(_dtensor_rank, 2, timeout=120):
        torch.testing.assert_close(l, loss.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g1, ref.fc1.weight.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(g2, ref.fc2.weight.grad, rtol=1e-4, atol=1e-6)
