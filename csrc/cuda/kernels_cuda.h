// Launchers of the CUDA kernels in csrc/cuda/*.cu (csrc/cuda: built only with CUDA). No torch
// types: device pointers, element counts and a stream. Every launcher checks its launch and
// throws tdx::Error with the CUDA error.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

namespace tdx {
namespace kernels {

// Compression (compress.cu), element math from compress_math.h; same results as compress_cpu.
void bf16CompressCuda(const float* in, uint16_t* out, int64_t n, cudaStream_t stream);
void bf16DecompressCuda(const uint16_t* in, float* out, int64_t n, cudaStream_t stream);
void fp16CompressCuda(const float* in, uint16_t* out, int64_t n, cudaStream_t stream);
void fp16DecompressCuda(const uint16_t* in, float* out, int64_t n, cudaStream_t stream);
// Blockwise int8 with error feedback: c = in + residual (residual may be null), per block
// scale = int8Scale(max |c|), q = quantizeInt8(c, scale), and residual = c - dequantize(q)
// when residual is given. One thread block per quantization block.
void int8QuantizeCuda(const float* in, float* residual, int64_t n, int block, int8_t* q, float* scales,
                      cudaStream_t stream);
// out = dequantize(q) (accumulate: out += dequantize(q)).
void int8DequantizeCuda(const int8_t* q, const float* scales, int64_t n, int block, float* out, bool accumulate,
                        cudaStream_t stream);

}  // namespace kernels
}  // namespace tdx

