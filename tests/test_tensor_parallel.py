"""Tensor parallelism: TP = 1, 2, 4 against the single-process model (loss and gradients), with and
without sequence parallelism; vocab-parallel embedding and cross-entropy; checkpoints across TP
degrees; plans and errors; torch's plan objects and torch's own DTensor TP on a tdx group."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from _dist import run_ranks
from _tp_models import MLP, Block, block_plan, run_sharded
from torchdist_ext import tensor_parallel as tp

MLP_PLAN = {"fc1": "colwise", "fc2": "rowwise"}


def _model(kind, seed=0):
    torch.manual_seed(seed)
    return MLP() if kind == "mlp" else Block()


def _data(seed=1):
    torch.manual_seed(seed)
    return torch.randn(2, 8, 16), torch.randn(2, 8, 16)


def _reference(kind):
    m = _model(kind)
    x, t = _data()
    loss = F.mse_loss(m(x), t)
    loss.backward()
    return loss.detach(), {k: p.grad for k, p in m.named_parameters()}


def _tp_rank(rank, ws, kind, sp, torch_styles):
    m = _model(kind)
    plan = MLP_PLAN if kind == "mlp" else block_plan("")
    if kind == "block" and sp:
        pass
    elif kind == "block":
        plan = {k: v for k, v in plan.items() if v != "sequence"}
    if torch_styles:
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
        conv = {"colwise": ColwiseParallel(input_layouts=Shard(1)) if sp else ColwiseParallel(),
                "rowwise": RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel(),
                "sequence": SequenceParallel()}
        plan = {k: conv[v] for k, v in plan.items()}
        tp.parallelize_module(m, None, plan)
    else:
        tp.parallelize_module(m, None, plan, sequence_parallel=sp)
    x, t = _data()
    loss = F.mse_loss(run_sharded(m, x, None, sp), t)
    loss.backward()
    return loss.detach(), {k: p.grad for k, p in m.state_dict(keep_vars=True).items()}, tp.tp_layout(m)


def _check(kind, ws, sp, torch_styles=False):
    ref_loss, ref_grads = _reference(kind)
    out = run_ranks(_tp_rank, ws, kind, sp, torch_styles)
    layout = out[0][2]
    merged = tp.merge_shards([o[1] for o in out], layout)
    for loss, _, _ in out:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert set(merged) == set(ref_grads)
    for k, g in ref_grads.items():
        torch.testing.assert_close(merged[k], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("ws", [1, 2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_mlp_matches_single_process(ws, sp):
    _check("mlp", ws, sp)


@pytest.mark.parametrize("ws", [1, 2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_block_matches_single_process(ws, sp):
    _check("block", ws, sp)


@pytest.mark.parametrize("sp", [False, True])
def test_torch_plan_objects(sp):
    _check("block", 2, sp, torch_styles=True)


def _bad_seq_rank(rank, ws):
    try:
        tp.reduce_scatter_seq(torch.ones(2, 3, 4), None, dim=1)
    except RuntimeError as e:
        return str(e)
    return None


def test_comm_op_rejects_sequence_not_divisible_before_communicating():
    for msg in run_ranks(_bad_seq_rank, 2, timeout=60, pg_timeout=20):
        assert msg is not None and "dim 1 of size 3 is not divisible by the tensor-parallel degree 2" in msg


def _shared_region_rank(rank, ws, sp):
    torch.manual_seed(0)
    h, b, s = 16, 2, 8
    blk = Block(h)
    plan = {k: v for k, v in block_plan().items() if sp or v != "sequence"}
    tp.parallelize_module(blk, None, plan, sequence_parallel=sp)
    x = torch.randn(b, s, h)
    tp.bytes_communicated(reset=True)
    run_sharded(blk, x, None, sp).sum().backward()
    return tp.bytes_communicated(reset=True)


@pytest.mark.parametrize("sp", [False, True])
def test_qkv_share_one_communication_of_their_input(sp):
    """Q, K and V read one tensor: one all-reduce of its gradient (one all-gather and one
    reduce-scatter under sequence parallelism), as Megatron's fused QKV layer does."""
    b, s, h = 2, 8, 16
    act = b * s * h * 4  # one fp32 activation
    for block_bytes in run_ranks(_shared_region_rank, 2, sp, timeout=120):
        if sp:
            # Bytes handed to collectives: an all-gather sends its shard (act / 2), a reduce-scatter
            # its full input (act). q/k/v: one gather forward + one reduce-scatter backward; o: a
            # reduce-scatter forward + a gather backward; the same for fc1 and fc2; gathering the
            # block's output adds a shard (x needs no gradient: split_seq's backward never runs).
            assert block_bytes == 4 * (act // 2 + act) + act // 2
        else:
            assert block_bytes == 4 * act  # o and fc2 forward, q/k/v and fc1 backward
