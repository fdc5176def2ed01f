"""The built-in comm hooks on CUDA buckets (csrc/reducer/builtin_hooks.cc over the CUDA kernels of
csrc/kernels) against the same hooks on CPU buckets, which tests/test_comm_hooks.py checks against a
single-process reference.

The model makes every gradient exact on both devices: loss = sum_i (p_i * x_i).sum(), so the
gradient of p_i is the rank's x_i, bit for bit on CPU and CUDA. What the hook then does to it
(compression, error feedback, the rank-order sum) must give the same bits on CUDA as on CPU, and
differ from the uncompressed all_reduce (so the CUDA path really compresses)."""
import os

import pytest
import torch
import torch.nn as nn

from _dist import run_ranks

SIZES = (1000, 70_000, 3, 300_001)  # several buckets at bucket_cap_mb=0.5, odd sizes, a tail block
STEPS = 4
SHARED = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}


class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(n, generator=g)) for n in SIZES])

    def forward(self, xs):
        return sum((p * x).sum() for p, x in zip(self.ps, xs))


def _hook(name):
    from torchdist_ext import comm_hooks

    return {
        "none": None,
        "fp16": (None, comm_hooks.fp16_compress),
        "bf16": (None, comm_hooks.bf16_compress),
        "int8": (comm_hooks.Int8State(block=256), comm_hooks.int8_quantize),
        "topk": (comm_hooks.TopKState(ratio=0.01), comm_hooks.topk_sparsify),
    }[name]


def _train_body(rank, world, device, hook):
    import torchdist_ext

    if device == "cuda":
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
    else:
        dev = torch.device("cpu")
    model = Probe().to(dev)
    ddp = torchdist_ext.DistributedDataParallel(model, device_ids=[0] if device == "cuda" else None,
                                                bucket_cap_mb=0.5)
    if _hook(hook) is not None:
        ddp.register_comm_hook(*_hook(hook))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        xs = [torch.randn(n, generator=g).to(dev) for n in SIZES]
        opt.zero_grad()
        ddp(xs).backward()
        opt.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("hook", ["fp16", "bf16", "int8", "topk"])
def test_builtin_hook_on_cuda_buckets_equals_cpu_buckets(hook):
    cuda = run_ranks(_train_body, 2, "cuda", hook, backend="tdx", timeout=300, env=SHARED)
    cpu = run_ranks(_train_body, 2, "cpu", hook, backend="tdx", timeout=300)
    plain = run_ranks(_train_body, 2, "cpu", "none", backend="tdx", timeout=300)
    for r in range(2):
        for i, (a, b) in enumerate(zip(cuda[r], cpu[r])):
            assert torch.equal(a, b), (hook, r, i, (a - b).abs().max().item())
    assert any(not torch.equal(a, b) for a, b in zip(cuda[0], plain[0])), f"{hook} on CUDA changed nothing"
