"""CPU-side checks of tdx's CUDA support: device routing errors (tensors of one call on different
devices, unsupported devices), and the coalescing blocks (start/end_coalescing) that the CUDA path
shares with the CPU path. The GPU-side tests are under tests/gpu; the shared-GPU detection logic
is unit-tested in tests/cpp/cuda_route_test.cc."""
import torch
import torch.distributed as dist

from _dist import run_ranks


def _device_errors_body(rank, world):
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    msgs = []
    for call in (
        lambda: backend.allreduce([torch.ones(4), torch.ones(4, device="meta")]),
        lambda: backend.allreduce([torch.ones(4, device="meta")]),
        lambda: backend._allgather_base(torch.ones(4 * world), torch.ones(4, device="meta")),
    ):
        try:
            call().wait()
            msgs.append("no error")
        except (RuntimeError, ValueError) as e:
            msgs.append(str(e))
    dist.barrier()
    return msgs


def test_device_errors_name_the_devices():
    msgs = run_ranks(_device_errors_body, 2)[0]
    assert "different devices (cpu and meta)" in msgs[0], msgs[0]
    assert "is on meta but tdx handles CPU and CUDA tensors only" in msgs[1], msgs[1]
    assert "different devices" in msgs[2] or "is on meta" in msgs[2], msgs[2]


def _coalesced_body(rank, world):
    xs = [torch.full((10 * (i + 1),), float(rank + i)) for i in range(3)]
    with dist._coalescing_manager(device=torch.device("cpu")):
        for x in xs:
            dist.all_reduce(x)
    ys = [torch.full((7,), float(rank))]
    with dist._coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
        dist.all_reduce(ys[0])
    cm.wait()
    return xs + ys


def test_coalescing_blocks_on_the_cpu_path():
    for world in (1, 3):
        out = run_ranks(_coalesced_body, world)
        total = sum(range(world))
        for r in range(world):
            for i in range(3):
                assert torch.equal(out[r][i], torch.full((10 * (i + 1),), float(total + world * i)))
            assert torch.equal(out[r][3], torch.full((7,), float(total)))
