"""torchdist_ext.FullyShardedDataParallel on CUDA over tdx, with and without cpu_offload, ranks
sharing one GPU: every stage trains to the single-process parameters; with cpu_offload the
shards, their gradients and the optimizer state live in CPU memory (the optimizer steps there)
while forward and backward run on the GPU. Skipped without a GPU (see conftest.py)."""
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from _dist import run_ranks

STEPS = 3
SHARED = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return torch.relu(self.fc(x))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(31, 67), Block(67), Block(67), nn.Linear(67, 5))  # no world size divides these


def _batches(world):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4 * world, 31, generator=g), torch.randint(0, 5, (4 * world,), generator=g))
            for _ in range(STEPS)]


def _reference(world):
    model = _model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for x, y in _batches(world):
        F.cross_entropy(model(x.cuda()), y.cuda()).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.cpu() for k, v in model.state_dict().items()}


def _train(rank, world, stage, offload):
    import torchdist_ext

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    model = torchdist_ext.FullyShardedDataParallel(_model().to(dev), stage=stage, cpu_offload=offload,
                                                   auto_wrap_policy=torchdist_ext.ModuleWrapPolicy({Block}))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    where = set()
    for x, y in _batches(world):
        xs, ys = x.chunk(world)[rank].to(dev), y.chunk(world)[rank].to(dev)
        out = model(xs)
        where.add(("output", out.device.type))
        F.cross_entropy(out, ys).backward()
        opt.step()
        where |= {("param", p.device.type) for p in model.parameters()}
        where |= {("grad", p.grad.device.type) for p in model.parameters() if p.grad is not None}
        where |= {("optimizer", v.device.type) for s in opt.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0}
        opt.zero_grad()
    torch.cuda.synchronize()
    return torchdist_ext.full_state_dict(model), sorted(where)


def _check(world, stage, offload, backend, env):
    results = run_ranks(_train, world, stage, offload, backend=backend, timeout=600, env=env)
    sd, where = results[0]
    ref = _reference(world)
    for k, v in ref.items():
        torch.testing.assert_close(sd[k], v, rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")
    state_device = "cpu" if offload else "cuda"
    assert where == sorted({("output", "cuda"), ("param", state_device), ("grad", state_device),
                            ("optimizer", state_device)}), where


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fsdp_on_cuda_with_and_without_cpu_offload(stage, offload):
    _check(2, stage, offload, "tdx", SHARED)


@pytest.mark.parametrize("backend", ["tdx", "nccl"])
def test_fsdp_world1_over_nccl(backend):
    """One rank: tdx takes its NCCL path, and torch's own nccl backend runs the same sharding."""
    _check(1, 3, False, backend, {})
