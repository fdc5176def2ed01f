// Tensor-level entry points of csrc/kernels (bound as torchdist_ext._C.kernels): validation with
// clear errors, then the CPU loops or the CUDA kernels on the current stream.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

namespace tdx {

// Offsets of tensors with `numels` elements in a flat buffer (each at a multiple of `align`,
// total a multiple of `divisor`); returns (offsets, total).
std::tuple<std::vector<int64_t>, int64_t> flatLayout(const std::vector<int64_t>& numels, int64_t align,
                                                     int64_t divisor);
// flat[offsets[i] : offsets[i] + numel] = tensors[i] * scale; the rest of flat becomes zero.
void packTensors(const std::vector<at::Tensor>& tensors, at::Tensor& flat, const std::vector<int64_t>& offsets,
                 double scale);
// tensors[i] = flat[offsets[i] : offsets[i] + numel].
void unpackTensors(const at::Tensor& flat, std::vector<at::Tensor>& tensors, const std::vector<int64_t>& offsets);

// CUDA only (the CPU loops of the same math are compress_cpu, used by the comm hooks).
at::Tensor compressHalf(const at::Tensor& x, bool bf16);          // float32 -> bfloat16 / float16
at::Tensor decompressHalf(const at::Tensor& x);                   // bfloat16 / float16 -> float32
std::tuple<at::Tensor, at::Tensor> int8Quantize(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                int64_t block);  // (q int8, scales float32)
void int8Dequantize(const at::Tensor& q, const at::Tensor& scales, int64_t block, at::Tensor& out, bool accumulate);

bool builtWithCuda();

}  // namespace tdx
