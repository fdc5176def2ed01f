// fp16 and bf16 SUM / AVG / scaled SUM (PREMUL_SUM) built for AVX-512 (F + BW): half_fold.h's loop
// (the one reduce_fold.h's AVX2 build runs) 32 elements per step instead of 16 (reduce_kernels.cc uses it for bf16 only; the
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

// The AVX-512 primitives of half_fold.h's loop: 32 values per step as two vectors of 16 floats.
struct Avx512Lanes {
  using F = __m512;
  static constexpr size_t kStep = 32;
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  template <bool kHalf>
  static void load(const uint16_t* p, F& lo, F& hi) { load32<kHalf>(p, lo, hi); }
  template <bool kHalf>
  static void store(uint16_t* p, F lo, F hi) { store32<kHalf>(p, lo, hi); }
  template <bool kHalf>
  static F round(F x) { return round16<kHalf>(x); }
};

#include "collectives/half_fold.h"

// mode 0: SUM, 1: AVG, 2: each term times `scale`, rounded to the storage type, then summed.
template <bool kHalf>
void foldMode(void* out, const void* const* in, int n, size_t count, int mode, float scale) {
  switch (mode) {
    case 0: return foldHalfLanes<kHalf, HalfFold::kSum, Avx512Lanes>(out, in, n, count, scale);
    case 1: return foldHalfLanes<kHalf, HalfFold::kAvg, Avx512Lanes>(out, in, n, count, scale);
    default: return foldHalfLanes<kHalf, HalfFold::kScaled, Avx512Lanes>(out, in, n, count, scale);
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
