"""tdx's own kernels: gradient compression on CUDA tensors.

The compression functions run on CUDA tensors (``csrc/cuda/compress.cu``); their element math
(``csrc/kernels/compress_math.h``) is shared with the CPU loops that the comm hooks use.
"""
from typing import Optional, Tuple

import torch

from . import _C

__all__ = [
    "built_with_cuda",
    "compress_bf16",
    "compress_fp16",
    "decompress",
    "int8_dequantize",
    "int8_quantize",
]

INT8_BLOCK = 256


def built_with_cuda() -> bool:
    """Whether this build of tdx has the CUDA kernels and the NCCL path."""
    return _C.kernels.built_with_cuda()


def compress_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 CUDA tensor -> bfloat16 (round to nearest even; NaN stays NaN)."""
    return _C.kernels.compress_half(x, True)


def compress_fp16(x: torch.Tensor) -> torch.Tensor:
    """float32 CUDA tensor -> float16 (round to nearest even, overflow to inf, subnormals kept)."""
    return _C.kernels.compress_half(x, False)


def decompress(x: torch.Tensor) -> torch.Tensor:
    """bfloat16 / float16 CUDA tensor -> float32."""
    return _C.kernels.decompress_half(x)


def int8_quantize(
    x: torch.Tensor, residual: Optional[torch.Tensor] = None, block: int = INT8_BLOCK
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Blockwise int8 quantization of ``c = x + residual`` (CUDA, float32), with error feedback.

    Per block of ``block`` elements: ``scale = max|c| / 127``, ``q = clamp(rint(c / scale), -127, 127)``.
    When ``residual`` is given it is updated in place to ``c - q * scale``. Returns ``(q, scales)``.
    """
    return _C.kernels.int8_quantize(x, residual, int(block))


def int8_dequantize(
    q: torch.Tensor,
    scales: torch.Tensor,
    block: int = INT8_BLOCK,
    out: Optional[torch.Tensor] = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """``q * scales[i // block]`` as float32 (``out +=`` that with ``accumulate``). Returns ``out``."""
    if out is None:
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    _C.kernels.int8_dequantize(q, scales, int(block), out, bool(accumulate))
    return out
