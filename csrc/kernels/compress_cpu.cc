#include "kernels/compress_cpu.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace tdx {
namespace kernels {

void bf16Compress(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = floatToBf16(in[i]);
}

void bf16Decompress(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16ToFloat(in[i]);
}

void fp16Compress(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = floatToHalf(in[i]);
}

void fp16Decompress(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = halfToFloat(in[i]);
}

void int8BlockQuantize(const float* in, int64_t n, int block, int8_t* q, float* scales) {
  for (int64_t b0 = 0, bi = 0; b0 < n; b0 += block, ++bi) {
    const int64_t b1 = std::min<int64_t>(n, b0 + block);
    float absmax = 0.0f;
    for (int64_t i = b0; i < b1; ++i) {
      const float a = std::fabs(in[i]);
      if (a > absmax || std::isnan(a)) absmax = a;  // a NaN makes the block's scale NaN
      if (std::isnan(absmax)) break;
    }
    const float scale = int8Scale(absmax);
    scales[bi] = scale;
    for (int64_t i = b0; i < b1; ++i) q[i] = quantizeInt8(in[i], scale);
  }
}

void int8BlockDequantize(const int8_t* q, const float* scales, int64_t n, int block, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = dequantizeInt8(q[i], scales[i / block]);
}

void int8BlockDequantizeAdd(const int8_t* q, const float* scales, int64_t n, int block, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] += dequantizeInt8(q[i], scales[i / block]);
}

void topkSelect(const float* in, int64_t n, int64_t k, int64_t* indices, float* values) {
  if (k <= 0) return;
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t{0});
  auto larger = [in](int64_t a, int64_t b) {
    const float x = std::fabs(in[a]), y = std::fabs(in[b]);
    const bool xn = std::isnan(x), yn = std::isnan(y);
    if (xn != yn) return xn;
    if (!xn && x != y) return x > y;
    return a < b;
  };
  if (k < n) std::nth_element(order.begin(), order.begin() + (k - 1), order.end(), larger);
  std::sort(order.begin(), order.begin() + k);
  for (int64_t j = 0; j < k; ++j) {
    indices[j] = order[static_cast<size_t>(j)];
    values[j] = in[indices[j]];
  }
}

void scatterAdd(const int64_t* indices, const float* values, int64_t k, float* out) {
  for (int64_t j = 0; j < k; ++j) out[indices[j]] += values[j];
}

}  // namespace kernels
}  // namespace tdx
