"""torchdist_ext.kernels on the CPU: flat layouts and the fused multi-tensor pack/unpack (the same
per-chunk code the CUDA kernels run) against torch.cat-style references, with poisoned outputs;
and the clear errors of bad arguments. The CUDA side is tests/gpu/test_gpu_kernels.py."""
import pytest
import torch

from torchdist_ext import kernels


def _tensors(dtype, sizes, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return [torch.randn(n, generator=g, dtype=torch.float64).to(dtype) for n in sizes]
    if dtype == torch.bool:
        return [torch.randint(0, 2, (n,), generator=g).bool() for n in sizes]
    return [torch.randint(-100, 100, (n,), generator=g).to(dtype) for n in sizes]


def test_flat_layout():
    assert kernels.flat_layout([3, 0, 5], align=4, divisor=1) == ([0, 4, 4], 9)
    assert kernels.flat_layout([3, 0, 5], align=4, divisor=4) == ([0, 4, 4], 12)
    assert kernels.flat_layout([], align=8, divisor=3) == ([], 0)
    with pytest.raises(ValueError, match="align must be >= 1"):
        kernels.flat_layout([1], align=0)
    with pytest.raises(ValueError, match="negative size"):
        kernels.flat_layout([1, -1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
                                   torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool])
@pytest.mark.parametrize("align,divisor", [(1, 1), (16, 3), (64, 4)])
def test_pack_unpack_round_trip(dtype, align, divisor):
    sizes = [0, 1, 17, 1000, 3, 70000, 5]
    ts = _tensors(dtype, sizes, 1)
    offsets, total = kernels.flat_layout(sizes, align=align, divisor=divisor)
    flat = torch.full((total,), 1, dtype=dtype) if dtype == torch.bool else torch.full((total,), 77, dtype=dtype)
    kernels.pack(ts, flat, offsets)
    want = torch.zeros(total, dtype=dtype)
    for o, t in zip(offsets, ts):
        want[o:o + t.numel()] = t
    assert torch.equal(flat, want)  # data in place, padding zeroed
    outs = [torch.full_like(t, 1 if dtype == torch.bool else 55) for t in ts]
    kernels.unpack(flat, outs, offsets)
    for o, t in zip(outs, ts):
        assert torch.equal(o, t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pack_with_scale_rounds_once(dtype):
    ts = [t.view(3, -1) for t in _tensors(dtype, [300, 6000], 2)]  # any shape packs flat
    flat = kernels.pack(ts, scale=1 / 3)
    want = torch.cat([(t.double() * torch.tensor(1 / 3, dtype=torch.float32).double()).to(dtype).flatten()
                      for t in ts])
    assert torch.equal(flat, want)


def test_pack_non_contiguous_inputs():
    base = torch.randn(40, 30)
    ts = [base[:, 3:9], base.t()]
    flat = kernels.pack(ts)
    assert torch.equal(flat, torch.cat([t.reshape(-1) for t in ts]))


def test_pack_errors_explain_themselves():
    with pytest.raises(TypeError, match="tensor 1 has dtype Double but the flat buffer has Float"):
        kernels.pack([torch.zeros(2), torch.zeros(2, dtype=torch.float64)], torch.zeros(4), [0, 2])
    with pytest.raises(ValueError, match="before the end of the previous entry"):
        kernels.pack([torch.zeros(2), torch.zeros(2)], torch.zeros(4), [0, 1])
    with pytest.raises(ValueError, match="only 3"):
        kernels.pack([torch.zeros(4)], torch.zeros(3), [0])
    with pytest.raises(ValueError, match="needs a float32 or float64"):
        kernels.pack([torch.zeros(4, dtype=torch.int32)], torch.zeros(4, dtype=torch.int32), [0], scale=0.5)
    with pytest.raises(ValueError, match="2 offsets for 1 tensors"):
        kernels.pack([torch.zeros(4)], torch.zeros(8), [0, 4])
    with pytest.raises(ValueError, match="not contiguous"):
        kernels.unpack(torch.zeros(8), [torch.zeros(4, 2).t()], [0])


def test_compression_kernels_need_cuda_tensors():
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        kernels.compress_bf16(torch.zeros(4))
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        kernels.int8_quantize(torch.zeros(4))
