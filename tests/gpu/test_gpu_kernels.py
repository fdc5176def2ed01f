"""The CUDA kernels against the CPU implementations of the same math (torch's casts, the float64
references below), on random data with poisoned outputs."""
import pytest
import torch

from torchdist_ext import kernels


def _rand(n, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g, dtype=torch.float64) * 50).to(dtype)


def _ref_bf16(x):
    return x.to(torch.bfloat16)  # torch's CPU cast: round to nearest even


def test_bf16_fp16_match_torch_casts():
    x = torch.cat([_rand(1 << 20, 1), torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 65519.0, 65520.0,
                                                  1e-8, 6e-8, 3e-8, 1e38])])
    for n in (x.numel(), x.numel() - 3, 1, 0):  # odd lengths take the scalar tail
        xs = x[:n]
        b = kernels.compress_bf16(xs.cuda())
        h = kernels.compress_fp16(xs.cuda())
        assert torch.equal(b.cpu().view(torch.int16), _ref_bf16(xs).view(torch.int16))
        assert torch.equal(h.cpu().view(torch.int16), xs.to(torch.float16).view(torch.int16))
        assert torch.equal(kernels.decompress(b).cpu(), b.cpu().float())
        assert torch.equal(kernels.decompress(h).cpu(), h.cpu().float())
    nan = kernels.compress_bf16(torch.tensor([float("nan")], device="cuda"))
    assert torch.isnan(nan.float()).all()


def _ref_int8(c, block):
    """float64 reference of the blockwise quantization of c (float32)."""
    n = c.numel()
    q = torch.empty(n, dtype=torch.int8)
    scales = torch.empty((n + block - 1) // block, dtype=torch.float32)
    for b in range(scales.numel()):
        blk = c[b * block:(b + 1) * block]
        scale = (blk.abs().max() / 127).to(torch.float32) if blk.numel() else torch.tensor(0.0)
        scales[b] = scale
        if scale == 0:
            q[b * block:(b + 1) * block] = 0
        else:
            q[b * block:(b + 1) * block] = torch.round(blk.double() / scale.double()).clamp(-127, 127).to(torch.int8)
    return q, scales


@pytest.mark.parametrize("block", [256, 100, 1])
def test_int8_quantize_with_error_feedback(block):
    g = _rand(10007, 3)
    r = _rand(10007, 4) * 0.01
    g[:block] = 0  # a block of zeros (input and residual) has scale 0
    r[:block] = 0
    rq = r.clone().cuda()
    q, scales = kernels.int8_quantize(g.cuda(), rq, block)
    c = g + r
    want_q, want_s = _ref_int8(c, block)
    assert torch.equal(scales.cpu(), want_s)
    assert scales[0].item() == 0 and not q[:block].any()
    # rint(x / scale) in float32 vs the float64 quotient may differ by one step at exact halves.
    assert (q.cpu().int() - want_q.int()).abs().max() <= 1
    deq = kernels.int8_dequantize(q, scales, block)
    assert torch.equal(rq.cpu(), c - deq.cpu())  # error feedback: residual = c - decompress(compress(c))
    acc = torch.ones_like(deq)
    kernels.int8_dequantize(q, scales, block, out=acc, accumulate=True)
    assert torch.equal(acc, deq + 1)


def test_kernel_errors_explain_themselves():
    with pytest.raises(TypeError, match="expected dtype Float"):
        kernels.compress_bf16(torch.zeros(4, dtype=torch.float64, device="cuda"))
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        kernels.compress_fp16(torch.zeros(4))
