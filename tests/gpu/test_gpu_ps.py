"""Central storage with CUDA workers: one server holds every parameter and the optimizer state in
host memory, the workers compute on the GPU (parameters pulled to it, gradients pushed back).
After a few synchronous steps the workers' GPU parameters and the server's must equal
single-process training on the whole batch (within the GPU's float32 rounding)."""
import torch

from _dist import run_ranks

STEPS, BATCH = 5, 24


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def _batches():
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(BATCH, 16, generator=g), torch.randint(0, 4, (BATCH,), generator=g)) for _ in range(STEPS)]


def _central(rank, world_size):
    from torchdist_ext import ps

    cfg = ps.central_storage(mode="sync")
    if ps.is_server(cfg):
        server = ps.ParameterServer(_net(), torch.optim.SGD, cfg, lr=0.1, momentum=0.9)
        server.run()
        return {n: p.detach().clone() for n, p in server.named_parameters()}
    dev = torch.device("cuda", (rank - 1) % torch.cuda.device_count())
    model = ps.Worker(_net().to(dev), cfg)
    assert all(p.is_cuda for p in model.parameters())
    opt = ps.PushOptimizer(model)
    n, i = world_size - 1, rank - 1
    for x, y in _batches():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x.chunk(n)[i].to(dev)), y.chunk(n)[i].to(dev)).backward()
        opt.step()
    model.close()
    return {k: v.detach().cpu() for k, v in model.module.named_parameters()}


def test_central_storage_with_cuda_workers_equals_single_process():
    out = run_ranks(_central, 3)
    ref = _net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for x, y in _batches():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    for name, want in ref.named_parameters():
        torch.testing.assert_close(out[0][name], want.detach(), rtol=1e-4, atol=1e-5)
        for r in (1, 2):
            torch.testing.assert_close(out[r][name], want.detach(), rtol=1e-4, atol=1e-5)
