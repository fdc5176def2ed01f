// CPU loops of the gradient compression hooks (torchdist_ext.comm_hooks) over the shared element
// math in compress_math.h. Torch-free: part of the CMake core and unit-tested with GoogleTest
// (tests/cpp/compress_cpu_test.cc). Every output element is written.
#pragma once

#include <cstdint>

#include "kernels/compress_math.h"

namespace tdx {
namespace kernels {

void bf16Compress(const float* in, uint16_t* out, int64_t n);
void bf16Decompress(const uint16_t* in, float* out, int64_t n);
void fp16Compress(const float* in, uint16_t* out, int64_t n);
void fp16Decompress(const uint16_t* in, float* out, int64_t n);

// Number of int8 blocks (= scales) of n elements.
inline int64_t int8NumBlocks(int64_t n, int block = kInt8Block) { return (n + block - 1) / block; }
// q[i] = quantizeInt8(in[i], scales[i / block]); scales[b] = int8Scale(max |in| over block b).
void int8BlockQuantize(const float* in, int64_t n, int block, int8_t* q, float* scales);
// out[i] = dequantizeInt8(q[i], scales[i / block]).
void int8BlockDequantize(const int8_t* q, const float* scales, int64_t n, int block, float* out);
// out[i] += dequantizeInt8(q[i], scales[i / block]) (summing the ranks' contributions).
void int8BlockDequantizeAdd(const int8_t* q, const float* scales, int64_t n, int block, float* out);

// The k entries of largest magnitude (ties: the lower index first), written in increasing index
// order: indices[j] and values[j] = in[indices[j]]. Requires 0 <= k <= n. NaN counts as largest.
void topkSelect(const float* in, int64_t n, int64_t k, int64_t* indices, float* values);
// out[indices[j]] += values[j] for j < k.
void scatterAdd(const int64_t* indices, const float* values, int64_t k, float* out);

}  // namespace kernels
}  // namespace tdx
