"""torchdist_ext.kernels on the CPU: the clear errors of bad arguments (the compression kernels run on
CUDA tensors only). The CUDA side is tests/gpu/test_gpu_kernels.py."""
import pytest
import torch

from torchdist_ext import kernels


def test_compression_kernels_need_cuda_tensors():
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        kernels.compress_bf16(torch.zeros(4))
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        kernels.int8_quantize(torch.zeros(4))


def test_built_with_cuda_says_whether_csrc_cuda_is_in_the_build():
    assert isinstance(kernels.built_with_cuda(), bool)
    if not kernels.built_with_cuda():
        with pytest.raises(ValueError, match="runs on CUDA tensors"):
            kernels.decompress(torch.zeros(4, dtype=torch.bfloat16))
