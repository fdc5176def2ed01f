// Element-wise math of the gradient compression hooks, shared by the CPU loops
// (csrc/kernels/compress_cpu.cc) and the CUDA kernels (csrc/cuda/compress.cu): no torch
// includes, plain C++17 and nvcc alike, so the CPU unit tests exercise the very math the GPU runs.
//
//   bf16:  round-to-nearest-even; +-inf stay +-inf.
//   fp16:  IEEE binary16, round-to-nearest-even, overflow (|x| >= 65520) -> +-inf, subnormals kept.
//   NaN (both, both directions): stays a NaN, quiet (the quiet bit set), with its sign and leading
//          payload bits: what x86's F16C and AVX512-BF16 conversions do, so they may stand in.
// These are the library's only fp16/bf16 converters: the reduction kernels
// (csrc/collectives/reduce_kernels.cc) use them too.
//   int8:  blocks of `block` elements (kInt8Block = 256 by default), one fp32 scale per block,
//          scale = max|x| / 127 (scale 0 -> every q is 0); q = clamp(rint(x / scale), -127, 127);
//          a NaN x quantizes to 0 (the scale of its block is NaN, so dequantizing shows it).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TDX_HD __host__ __device__ __forceinline__
#else
#define TDX_HD inline
#endif

namespace tdx {
namespace kernels {

TDX_HD uint32_t floatBits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

TDX_HD float bitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

// Branch-free, so loops over it vectorize.
TDX_HD uint16_t floatToBf16(float x) {
  const uint32_t u = floatBits(x);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;  // round to nearest, ties to even
  const uint32_t quiet = (u >> 16) | 0x0040u;                        // NaN: quiet, sign and payload kept
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? quiet : rounded);
}

TDX_HD float bf16ToFloat(uint16_t b) { return bitsFloat(static_cast<uint32_t>(b) << 16); }

TDX_HD uint16_t floatToHalf(float x) {
  const uint32_t u = floatBits(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));  // quiet NaN
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 rounds to inf (and inf)
  if (a < 0x38800000u) {  // below 2^-14: a half subnormal (or zero)
    const uint32_t e = a >> 23;
    if (e < 102u) return static_cast<uint16_t>(sign);  // below 2^-25: rounds to zero
    const uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126u - e;  // 14..24
    uint32_t m = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (m & 1u))) ++m;  // may carry into the smallest normal: still right
    return static_cast<uint16_t>(sign | m);
  }
  uint32_t h = (a - 0x38000000u) >> 13;  // rebias the exponent (127 -> 15), keep 10 mantissa bits
  const uint32_t rem = a & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is right too
  return static_cast<uint16_t>(sign | h);
}

TDX_HD float halfToFloat(uint16_t h) {
  const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  if (e == 0) {
    const float v = static_cast<float>(m) * 5.9604644775390625e-8f;  // m * 2^-24, exact
    return sign ? -v : v;
  }
  if (e == 31) return bitsFloat(sign | 0x7F800000u | (m << 13) | (m ? 0x00400000u : 0u));  // NaN: quiet
  return bitsFloat(sign | ((e + 112u) << 23) | (m << 13));
}

constexpr int kInt8Block = 256;

TDX_HD float int8Scale(float absmax) { return absmax / 127.0f; }

TDX_HD int8_t quantizeInt8(float x, float scale) {
  if (scale == 0.0f) return 0;
  float v = rintf(x / scale);
  if (!(v == v)) return 0;  // NaN
  v = v < -127.0f ? -127.0f : (v > 127.0f ? 127.0f : v);
  return static_cast<int8_t>(v);
}

TDX_HD float dequantizeInt8(int8_t q, float scale) { return static_cast<float>(q) * scale; }

}  // namespace kernels
}  // namespace tdx
