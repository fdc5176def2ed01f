"""tdx's own kernels: fused multi-tensor pack/unpack and gradient compression.

``pack``/``unpack`` move a list of tensors into / out of one flat buffer in one fused pass (a DDP
bucket, an FSDP flat parameter): on CPU tensors with C++ loops, on CUDA tensors with one kernel
launch per 32 tensors on the current stream. Both run the same per-element code
(``csrc/kernels/pack_math.h``).

The compression functions run on CUDA tensors (``csrc/kernels/compress.cu``); their element math
(``csrc/kernels/compress_math.h``) is shared with the CPU loops that the comm hooks use.
"""
from typing import List, Optional, Sequence, Tuple

import torch

from . import _C

__all__ = [
    "built_with_cuda",
    "compress_bf16",
    "compress_fp16",
    "decompress",
    "flat_layout",
    "int8_dequantize",
    "int8_quantize",
    "pack",
    "unpack",
]

INT8_BLOCK = 256


def built_with_cuda() -> bool:
    """Whether this build of tdx has the CUDA kernels and the NCCL path."""
    return _C.kernels.built_with_cuda()


def flat_layout(numels: Sequence[int], align: int = 1, divisor: int = 1) -> Tuple[List[int], int]:
    """Offsets of tensors of ``numels`` elements in a flat buffer, and its total length.

    Each tensor starts at a multiple of ``align`` elements; the total is rounded up to a multiple
    of ``divisor`` (for FSDP, the world size, so that every rank's shard is the same length).
    """
    return _C.kernels.flat_layout([int(n) for n in numels], int(align), int(divisor))


def pack(
    tensors: Sequence[torch.Tensor],
    flat: Optional[torch.Tensor] = None,
    offsets: Optional[Sequence[int]] = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """Writes ``tensors[i] * scale`` to ``flat[offsets[i]:offsets[i] + numel]`` and zeros elsewhere.

    Without ``offsets`` the tensors are laid out back to back; without ``flat`` a buffer of the
    right size is allocated on the tensors' device. ``scale`` applies to float32/float64 only (e.g.
    ``1 / world_size`` for DDP averaging). Returns ``flat``.
    """
    tensors = list(tensors)
    if offsets is None:
        offsets, total = flat_layout([t.numel() for t in tensors])
    else:
        offsets = [int(o) for o in offsets]
        total = max([o + t.numel() for o, t in zip(offsets, tensors)], default=0)
    if flat is None:
        if not tensors:
            raise ValueError("pack: pass at least one tensor, or a flat buffer to fill with zeros")
        flat = torch.empty(total, dtype=tensors[0].dtype, device=tensors[0].device)
    _C.kernels.pack(tensors, flat, list(offsets), float(scale))
    return flat


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Optional[Sequence[int]] = None) -> None:
    """Copies ``flat[offsets[i]:offsets[i] + numel]`` into each (contiguous) ``tensors[i]``."""
    tensors = list(tensors)
    if offsets is None:
        offsets, _ = flat_layout([t.numel() for t in tensors])
    _C.kernels.unpack(flat, tensors, [int(o) for o in offsets])


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
