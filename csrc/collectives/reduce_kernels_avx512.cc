// fp16 and bf16 SUM / AVG / scaled SUM (PREMUL_SUM) built for AVX-512 (F + BW): reduce_fold.h's
// foldHalfWidth 32 elements per step instead of 16 (reduce_kernels.cc uses it for bf16 only; the
// fp16 build is kept and tested, but measured no quicker). The same bits as the AVX2 + F16C loop and the
// baseline build (reduce_kernels_test checks every 16-bit pattern): widened to float, added left to
// right, rounded once with the shared converter's rule (to nearest, ties to even; a NaN stays a quiet
// NaN with its sign and leading payload bits). reduce_kernels.cc calls it when the CPU has AVX-512
// and TDX_REDUCE_ISA is not "generic" or "avx2". A bf16 all_reduce spends most of its time here: at
// 1 MB on 2 ranks it took 182 us against fp32's 112 us with half the bytes.
#include <cstddef>
#include <cstdint>

#include "collectives/types.h"
#include "common/env.h"
#include "kernels/compress_math.h"

namespace tdx::fold_avx512 {

bool usable() {
  if (reduceIsaWithoutAvx512()) return false;
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();  // may run in a static initializer, before libgcc's own
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

}  // namespace tdx::fold_avx512

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx2,f16c")
// GCC 12 warns inside its own avx512fintrin.h (an `undefined` vector it passes to the masked forms).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace tdx::fold_avx512 {
namespace {

// 32 values as two vectors of 16 floats. bf16 widens by interleaving with zeros within each 128-bit
// lane (elements 0-3, 8-11, 16-19, 24-27 in `lo`); the element-wise fold keeps that order and
// store32's pack, also per 128-bit lane, undoes it.
template <bool kHalf>
inline void load32(const uint16_t* p, __m512& lo, __m512& hi) {
  if constexpr (kHalf) {
    lo = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    hi = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)));
  } else {
    const __m512i v = _mm512_loadu_si512(p);
    const __m512i zero = _mm512_setzero_si512();
    lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, v));
    hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, v));
  }
}

// The float's bits rounded to bf16 in the upper half of each 32-bit lane (lower half garbage).
inline __m512i bf16Upper(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __m512i quiet = _mm512_or_si512(u, _mm512_set1_epi32(0x00400000));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_blend_epi32(nan, rounded, quiet);
}

template <bool kHalf>
inline void store32(uint16_t* p, __m512 lo, __m512 hi) {
  if constexpr (kHalf) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 16), _mm512_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT));
  } else {
    const __m512i a = _mm512_srli_epi32(bf16Upper(lo), 16), b = _mm512_srli_epi32(bf16Upper(hi), 16);
    _mm512_storeu_si512(p, _mm512_packus_epi32(a, b));  // lanes < 65536
  }
}

// The value rounded to the storage type and widened again (a scaled term is stored before it is summed).
template <bool kHalf>
inline __m512 round16(__m512 x) {
  if constexpr (kHalf) {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  } else {
    return _mm512_castsi512_ps(_mm512_and_si512(bf16Upper(x), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
}

inline float load1(bool half, uint16_t v) { return half ? _cvtsh_ss(v) : kernels::bf16ToFloat(v); }
inline uint16_t store1(bool half, float a) {
  return half ? _cvtss_sh(a, _MM_FROUND_TO_NEAREST_INT) : kernels::floatToBf16(a);
}

// mode 0: SUM, 1: AVG, 2: each term times `scale`, rounded to the storage type, then summed.
template <bool kHalf, int kMode>
void fold(void* outv, const void* const* inv, int n, size_t count, float scale) {
  auto* out = static_cast<uint16_t*>(outv);
  const auto in = [inv](int k) { return static_cast<const uint16_t*>(inv[k]); };
  const float div = static_cast<float>(n);
  const __m512 sv = _mm512_set1_ps(scale);
  const auto term = [&](int k, size_t i, __m512& lo, __m512& hi) {
    load32<kHalf>(in(k) + i, lo, hi);
    if constexpr (kMode == 2) {
      lo = round16<kHalf>(_mm512_mul_ps(lo, sv));
      hi = round16<kHalf>(_mm512_mul_ps(hi, sv));
    }
  };
  const auto scalarTerm = [&](int k, size_t i) {
    const float v = load1(kHalf, in(k)[i]);
    return kMode == 2 ? load1(kHalf, store1(kHalf, v * scale)) : v;
  };
  size_t i = 0;
  for (; i + 32 <= count; i += 32) {
    __m512 a, b;
    term(0, i, a, b);
    for (int k = 1; k < n; ++k) {
      __m512 c, d;
      term(k, i, c, d);
      a = _mm512_add_ps(a, c);
      b = _mm512_add_ps(b, d);
    }
    if constexpr (kMode == 1) {
      a = _mm512_div_ps(a, _mm512_set1_ps(div));
      b = _mm512_div_ps(b, _mm512_set1_ps(div));
    }
    store32<kHalf>(out + i, a, b);
  }
  for (; i < count; ++i) {
    float a = scalarTerm(0, i);
    for (int k = 1; k < n; ++k) a = a + scalarTerm(k, i);
    out[i] = store1(kHalf, kMode == 1 ? a / div : a);
  }
}

template <bool kHalf>
void foldMode(void* out, const void* const* in, int n, size_t count, int mode, float scale) {
  switch (mode) {
    case 0: return fold<kHalf, 0>(out, in, n, count, scale);
    case 1: return fold<kHalf, 1>(out, in, n, count, scale);
    default: return fold<kHalf, 2>(out, in, n, count, scale);
  }
}

}  // namespace

bool foldHalf(void* out, const void* const* in, int n, size_t count, DataType dt, int mode, float scale) {
  if (dt == DataType::kFloat16) {
    foldMode<true>(out, in, n, count, mode, scale);
    return true;
  }
  if (dt == DataType::kBFloat16) {
    foldMode<false>(out, in, n, count, mode, scale);
    return true;
  }
  return false;
}

}  // namespace tdx::fold_avx512

#pragma GCC diagnostic pop
#pragma GCC pop_options
#else
namespace tdx::fold_avx512 {
bool foldHalf(void*, const void* const*, int, size_t, DataType, int, float) { return false; }
}  // namespace tdx::fold_avx512
#endif
