"""Training with tdx on CUDA: torch's DDP (its reducer uses get_future on our CUDA-aware futures),
torchdist_ext.DistributedDataParallel, and torch's FSDP2 (all_gather_into_tensor /
reduce_scatter_tensor), with 2-4 ranks sharing one GPU (staged) or one GPU per rank (NCCL).
Parameters after a few steps must match a single-process reference on the whole batch."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from _dist import run_ranks

STEPS = 4


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 256)
        self.b = nn.Linear(256, 256)
        self.c = nn.Linear(256, 10)

    def forward(self, x):
        return self.c(F.relu(self.b(F.relu(self.a(x)))))


def _batches(world):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8 * world, 32, generator=g), torch.randint(0, 10, (8 * world,), generator=g))
            for _ in range(STEPS)]


def _reference(world):
    torch.manual_seed(0)
    model = MLP().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches(world):
        opt.zero_grad()
        F.cross_entropy(model(x.cuda()), y.cuda()).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


def _train_body(rank, world, kind):
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = MLP().to(dev)
    if kind == "torch_ddp":
        model = nn.parallel.DistributedDataParallel(model, device_ids=[dev.index], bucket_cap_mb=0.1)
    elif kind == "tdx_ddp":
        import torchdist_ext

        model = torchdist_ext.DistributedDataParallel(model, device_ids=[dev.index], bucket_cap_mb=0.1)
    elif kind == "fsdp2":
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:
            from torch.distributed._composable.fsdp import fully_shard
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda", (world,))
        for m in (model.a, model.b, model.c):
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches(world):
        opt.zero_grad()
        xs, ys = x.chunk(world)[rank].to(dev), y.chunk(world)[rank].to(dev)
        F.cross_entropy(model(xs), ys).backward()
        opt.step()
    torch.cuda.synchronize()
    if kind == "fsdp2":
        return [p.full_tensor().detach().cpu() for p in model.parameters()]
    return [p.detach().cpu() for p in model.parameters()]


def _check(world, kind, env, backend="tdx"):
    got = run_ranks(_train_body, world, kind, backend=backend, timeout=600, env=env)
    want = _reference(world)
    for r in range(world):
        for g, w in zip(got[r], want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    for r in range(1, world):  # every rank holds the same parameters, bit for bit
        for a, b in zip(got[0], got[r]):
            assert torch.equal(a, b)


SHARED = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}


@pytest.mark.parametrize("kind", ["torch_ddp", "tdx_ddp", "fsdp2"])
@pytest.mark.parametrize("world", [2, 4])
def test_training_with_ranks_sharing_one_gpu(kind, world):
    _check(world, kind, SHARED)


@pytest.mark.parametrize("kind", ["torch_ddp", "tdx_ddp", "fsdp2"])
def test_training_one_gpu_per_rank(kind):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    _check(2, kind, {})


@pytest.mark.parametrize("kind", ["torch_ddp", "tdx_ddp"])
@pytest.mark.parametrize("backend", ["tdx", "nccl"])
def test_training_world1_nccl(kind, backend):
    """One rank: tdx takes its NCCL path; torch's own nccl backend under our DDP too."""
    _check(1, kind, {}, backend)
