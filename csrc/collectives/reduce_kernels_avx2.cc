// The folds of reduce_fold.h built for AVX2 + F16C (GCC vectorizes the loops 8 floats wide, and
// fp16 converts with vcvtph2ps / vcvtps2ph); reduce_kernels.cc calls them when the CPU has both
// and TDX_REDUCE_ISA is not "generic".
#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "collectives/types.h"
#include "common/env.h"
#include "common/logging.h"
#include "kernels/compress_math.h"

namespace tdx::fold_avx2 {
bool usable() {
  if (reduceIsaGeneric()) return false;
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();  // may run in a static initializer, before libgcc's own
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}
}  // namespace tdx::fold_avx2

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,f16c")

namespace tdx::fold_avx2 {
namespace {
// 16 fp16 (kHalf) or bf16 values as two vectors of 8 floats, and back with the shared converter's
// rounding (to nearest, ties to even) and NaN rule (quiet, sign and leading payload kept): the same
// bits as the scalar Elem<...>::load / store (reduce_kernels_test checks every 16-bit pattern).
// bf16 widens by interleaving with zeros, which puts elements 0-3, 8-11 in `lo` and 4-7, 12-15 in
// `hi`; the element-wise fold keeps that order and store16's pack undoes it.
template <bool kHalf>
inline void load16(const uint16_t* p, __m256& lo, __m256& hi) {
  if constexpr (kHalf) {
    lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  } else {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i zero = _mm256_setzero_si256();
    lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
    hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
  }
}

// The float's bits rounded to bf16 in the upper half of each 32-bit lane (lower half garbage).
inline __m256i bf16Upper(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x00400000));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}

template <bool kHalf>
inline void store16(uint16_t* p, __m256 lo, __m256 hi) {
  if constexpr (kHalf) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT));
  } else {
    const __m256i a = _mm256_srli_epi32(bf16Upper(lo), 16), b = _mm256_srli_epi32(bf16Upper(hi), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_packus_epi32(a, b));  // lanes < 65536
  }
}

inline float load1(bool half, uint16_t v) { return half ? _cvtsh_ss(v) : kernels::bf16ToFloat(v); }
inline uint16_t store1(bool half, float a) {
  return half ? _cvtss_sh(a, _MM_FROUND_TO_NEAREST_INT) : kernels::floatToBf16(a);
}
}  // namespace

// SUM / AVG of n fp16 or bf16 inputs, accumulated in float left to right and rounded once, 16
// elements per step (GCC does not vectorize the scalar template's conversions: a 64 KiB bf16 fold
// of two inputs took 8.9 us against 2.0 us for 64 KiB of fp32, fp16 32.8 us). Every input's
// elements are read before the output's are written, so `out` may alias an input exactly.
template <bool kHalf, bool kAvg>
void foldHalfWidth(void* outv, const void* const* inv, int n, size_t count) {
  auto* out = static_cast<uint16_t*>(outv);
  const auto in = [inv](int k) { return static_cast<const uint16_t*>(inv[k]); };
  const float div = static_cast<float>(n);
  size_t i = 0;
  for (; i + 16 <= count; i += 16) {
    __m256 a, b;
    load16<kHalf>(in(0) + i, a, b);
    for (int k = 1; k < n; ++k) {
      __m256 c, d;
      load16<kHalf>(in(k) + i, c, d);
      a = _mm256_add_ps(a, c);
      b = _mm256_add_ps(b, d);
    }
    if constexpr (kAvg) {
      a = _mm256_div_ps(a, _mm256_set1_ps(div));
      b = _mm256_div_ps(b, _mm256_set1_ps(div));
    }
    store16<kHalf>(out + i, a, b);
  }
  for (; i < count; ++i) {
    float a = load1(kHalf, in(0)[i]);
    for (int k = 1; k < n; ++k) a = a + load1(kHalf, in(k)[i]);
    out[i] = store1(kHalf, kAvg ? a / div : a);
  }
}
}  // namespace tdx::fold_avx2

#define TDX_FOLD_HALF_WIDTH 1
#define TDX_FOLD_NS fold_avx2
#define TDX_FOLD_F16C 1
#include "collectives/reduce_fold.h"
#undef TDX_FOLD_F16C
#undef TDX_FOLD_NS
#undef TDX_FOLD_HALF_WIDTH
#pragma GCC pop_options
#else
// Not x86: usable() is false and these are never called; they forward to the generic build.
namespace tdx {
namespace fold_generic {
void reduceIntoImpl(void* out, const void* const* in, int n, size_t count, DataType dt, ReduceOp op);
void reduceScaledSumImpl(void* out, const void* const* in, int n, size_t count, DataType dt, double s);
}  // namespace fold_generic
namespace fold_avx2 {
void reduceIntoImpl(void* out, const void* const* in, int n, size_t count, DataType dt, ReduceOp op) {
  fold_generic::reduceIntoImpl(out, in, n, count, dt, op);
}
void reduceScaledSumImpl(void* out, const void* const* in, int n, size_t count, DataType dt, double s) {
  fold_generic::reduceScaledSumImpl(out, in, n, count, dt, s);
}
}  // namespace fold_avx2
}  // namespace tdx
#endif
