// Tensor-level entry points of the compression kernels (bound as torchdist_ext._C.kernels):
// validation with clear errors, then the CUDA kernels on the current stream (csrc/cuda).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace tdx {

// CUDA only (the CPU loops of the same math are compress_cpu, used by the comm hooks).
at::Tensor compressHalf(const at::Tensor& x, bool bf16);          // float32 -> bfloat16 / float16
at::Tensor decompressHalf(const at::Tensor& x);                   // bfloat16 / float16 -> float32
std::tuple<at::Tensor, at::Tensor> int8Quantize(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                int64_t block);  // (q int8, scales float32)
void int8Dequantize(const at::Tensor& q, const at::Tensor& scales, int64_t block, at::Tensor& out, bool accumulate);

bool builtWithCuda();

}  // namespace tdx
