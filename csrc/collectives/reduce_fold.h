// The element-wise folds behind reduceInto / reduceScaledSumInto, as templates. Included by
// reduce_kernels.cc (namespace fold_generic, the baseline ISA) and reduce_kernels_avx2.cc (namespace
// fold_avx2, built for AVX2 + F16C and chosen at run time when the CPU has them): one source, two
// builds, each in its own namespace so the linker never mixes them. No FMA in either, so both
// round every product and sum alike (ranks on different CPUs still agree bit for bit).
//
// Include it only after defining TDX_FOLD_NS (and, for the AVX2 + F16C build, TDX_FOLD_F16C).
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "collectives/types.h"
#include "common/logging.h"
#include "kernels/compress_math.h"

namespace tdx {
namespace TDX_FOLD_NS {

struct HalfTag {};
struct BFloat16Tag {};

// Storage type, accumulator type, load and store for each dtype.
template <typename T, bool = std::is_integral_v<T>&& std::is_signed_v<T>>
struct AccOf {
  using type = T;
};
template <typename T>
struct AccOf<T, true> {
  using type = std::make_unsigned_t<T>;
};

template <typename T>
struct Elem {
  using Store = T;
  using Acc = typename AccOf<T>::type;
  static Acc load(Store v) { return static_cast<Acc>(v); }
  static Store store(Acc a) { return static_cast<Store>(a); }
};
// fp16 through the F16C instructions where this copy is built for them (the same bits as the shared
// converter: reduce_kernels_test checks every value), else through the shared converter.
template <>
struct Elem<HalfTag> {
  using Store = uint16_t;
  using Acc = float;
#ifdef TDX_FOLD_F16C
  static Acc load(Store v) { return _cvtsh_ss(v); }
  static Store store(Acc a) { return _cvtss_sh(a, _MM_FROUND_TO_NEAREST_INT); }
#else
  static Acc load(Store v) { return kernels::halfToFloat(v); }
  static Store store(Acc a) { return kernels::floatToHalf(a); }
#endif
};
template <>
struct Elem<BFloat16Tag> {
  using Store = uint16_t;
  using Acc = float;
  static Acc load(Store v) { return kernels::bf16ToFloat(v); }
  static Store store(Acc a) { return kernels::floatToBf16(a); }
};

#ifdef TDX_FOLD_F16C
// 16 fp16 (kHalf) or bf16 values as two vectors of 8 floats, and back with the shared converter's
// rounding (to nearest, ties to even) and NaN rule (quiet, sign and leading payload kept): the same
// bits as Elem<...>::load / store (reduce_kernels_test checks every 16-bit pattern).
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


// The value rounded to the storage type and widened again (a scaled term is stored before it is
// summed, as Elem<...>::load(Elem<...>::store(x)) does).
template <bool kHalf>
inline __m256 round16(__m256 x) {
  if constexpr (kHalf) {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  } else {
    return _mm256_castsi256_ps(_mm256_and_si256(bf16Upper(x), _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
}

// The AVX2 + F16C primitives of half_fold.h's loop: 16 values per step as two vectors of 8 floats.
struct Avx2Lanes {
  using F = __m256;
  static constexpr size_t kStep = 16;
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  template <bool kHalf>
  static void load(const uint16_t* p, F& lo, F& hi) { load16<kHalf>(p, lo, hi); }
  template <bool kHalf>
  static void store(uint16_t* p, F lo, F hi) { store16<kHalf>(p, lo, hi); }
  template <bool kHalf>
  static F round(F x) { return round16<kHalf>(x); }
};

#include "collectives/half_fold.h"

// fp16 / bf16 SUM, AVG and scaled SUM through half_fold.h's loop, 16 elements per step (GCC does not
// vectorize the scalar template's conversions: a 64 KiB bf16 fold of two inputs took 8.9 us against
// 2.0 us for 64 KiB of fp32, fp16 32.8 us).
template <typename T, HalfFold kMode>
void foldHalfWidth(void* outv, const void* const* inv, int n, size_t count, float scale = 1.0f) {
  foldHalfLanes<std::is_same_v<T, HalfTag>, kMode, Avx2Lanes>(outv, inv, n, count, scale);
}
#endif  // TDX_FOLD_F16C

// Signed integers are compared in their own type (the accumulator is unsigned for wrapping sums).
template <typename T, typename A>
inline bool less(A a, A b) {
  if constexpr (std::is_integral_v<T> && std::is_signed_v<T>) {
    return static_cast<T>(a) < static_cast<T>(b);
  } else {
    return a < b;
  }
}

template <typename T, ReduceOp Op>
struct Fold {
  using E = Elem<T>;
  using A = typename E::Acc;
  static A apply(A a, A b) {
    if constexpr (Op == ReduceOp::kSum || Op == ReduceOp::kAvg) {
      return static_cast<A>(a + b);
    } else if constexpr (Op == ReduceOp::kProduct) {
      return static_cast<A>(a * b);
    } else if constexpr (Op == ReduceOp::kMin) {
      if constexpr (std::is_floating_point_v<A>) {
        return (b != b || b < a) ? b : a;  // NaN propagates
      } else {
        return less<T>(b, a) ? b : a;
      }
    } else if constexpr (Op == ReduceOp::kMax) {
      if constexpr (std::is_floating_point_v<A>) {
        return (b != b || a < b) ? b : a;
      } else {
        return less<T>(a, b) ? b : a;
      }
    } else if constexpr (Op == ReduceOp::kBand) {
      return static_cast<A>(a & b);
    } else if constexpr (Op == ReduceOp::kBor) {
      return static_cast<A>(a | b);
    } else {
      return static_cast<A>(a ^ b);
    }
  }
};

constexpr size_t kBlock = 512;
constexpr int kMaxUnrolled = 8;

// out[i] = last(fold(...fold(first(in[0][i]), in[1][i])..., in[n-1][i])), left to right.
//
// Up to kMaxUnrolled inputs: one pass with the accumulator in a register, N a compile-time
// constant so the compiler unrolls the inner loop and vectorizes the outer one (about twice as fast
// as the blocked loop for fp32 sums of two inputs). More inputs: blocks of kBlock accumulators.
// Both read every input's element i before writing out[i], so `out` may alias an input exactly.
template <int N, typename S, typename First, typename Step, typename Last>
void foldUnrolled(S* out, const void* const* inv, size_t count, First first, Step step, Last last) {
  const S* in[N];
  for (int k = 0; k < N; ++k) in[k] = static_cast<const S*>(inv[k]);
#pragma GCC ivdep
  for (size_t i = 0; i < count; ++i) {
    auto acc = first(in[0][i]);
    for (int k = 1; k < N; ++k) acc = step(acc, in[k][i]);
    out[i] = last(acc);
  }
}

template <typename S, typename First, typename Step, typename Last>
void foldRows(void* outv, const void* const* inv, int n, size_t count, First first, Step step, Last last) {
  S* out = static_cast<S*>(outv);
  switch (n) {
    case 1: return foldUnrolled<1, S>(out, inv, count, first, step, last);
    case 2: return foldUnrolled<2, S>(out, inv, count, first, step, last);
    case 3: return foldUnrolled<3, S>(out, inv, count, first, step, last);
    case 4: return foldUnrolled<4, S>(out, inv, count, first, step, last);
    case 5: return foldUnrolled<5, S>(out, inv, count, first, step, last);
    case 6: return foldUnrolled<6, S>(out, inv, count, first, step, last);
    case 7: return foldUnrolled<7, S>(out, inv, count, first, step, last);
    case kMaxUnrolled: return foldUnrolled<kMaxUnrolled, S>(out, inv, count, first, step, last);
    default: break;
  }
  using A = decltype(first(S{}));
  A acc[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t m = count - base < kBlock ? count - base : kBlock;
    const S* in0 = static_cast<const S*>(inv[0]) + base;
    for (size_t i = 0; i < m; ++i) acc[i] = first(in0[i]);
    for (int k = 1; k < n; ++k) {
      const S* ink = static_cast<const S*>(inv[k]) + base;
      for (size_t i = 0; i < m; ++i) acc[i] = step(acc[i], ink[i]);
    }
    for (size_t i = 0; i < m; ++i) out[base + i] = last(acc[i]);
  }
}

template <typename T, ReduceOp Op>
void reduceTyped(void* out, const void* const* in, int n, size_t count) {
#ifdef TDX_FOLD_F16C
  // fp16 / bf16 SUM and AVG: the explicit AVX2 loop above (same bits).
  if constexpr ((std::is_same_v<T, HalfTag> || std::is_same_v<T, BFloat16Tag>) &&
                (Op == ReduceOp::kSum || Op == ReduceOp::kAvg)) {
    return foldHalfWidth<T, Op == ReduceOp::kAvg ? HalfFold::kAvg : HalfFold::kSum>(out, in, n, count);
  }
#endif
  using E = Elem<T>;
  using S = typename E::Store;
  using A = typename E::Acc;
  auto first = [](S v) -> A { return E::load(v); };
  auto step = [](A acc, S v) -> A { return Fold<T, Op>::apply(acc, E::load(v)); };
  if constexpr (Op == ReduceOp::kAvg && std::is_floating_point_v<A>) {
    const A div = static_cast<A>(n);
    foldRows<S>(out, in, n, count, first, step, [div](A a) -> S { return E::store(a / div); });
  } else {
    foldRows<S>(out, in, n, count, first, step, [](A a) -> S { return E::store(a); });
  }
}

template <typename T>
void reduceScaledSum(void* out, const void* const* in, int n, size_t count, double scale) {
#ifdef TDX_FOLD_F16C
  if constexpr (std::is_same_v<T, HalfTag> || std::is_same_v<T, BFloat16Tag>) {
    return foldHalfWidth<T, HalfFold::kScaled>(out, in, n, count, static_cast<float>(scale));
  }
#endif
  using E = Elem<T>;
  using S = typename E::Store;
  using A = typename E::Acc;
  const A s = static_cast<A>(scale);
  // The product is rounded to the storage type (fp16/bf16 products are stored before summing).
  auto scaled = [s](S v) -> A {
    if constexpr (std::is_same_v<S, A>) {
      return v * s;
    } else {
      return E::load(E::store(E::load(v) * s));
    }
  };
  foldRows<S>(out, in, n, count, scaled, [scaled](A acc, S v) -> A { return acc + scaled(v); },
              [](A a) -> S { return E::store(a); });
}

template <typename T>
void reduceOpDispatch(void* out, const void* const* in, int n, size_t count, ReduceOp op) {
  constexpr bool kFloat = std::is_floating_point_v<typename Elem<T>::Acc>;
  switch (op) {
    case ReduceOp::kSum: return reduceTyped<T, ReduceOp::kSum>(out, in, n, count);
    case ReduceOp::kAvg: return reduceTyped<T, ReduceOp::kAvg>(out, in, n, count);
    case ReduceOp::kProduct: return reduceTyped<T, ReduceOp::kProduct>(out, in, n, count);
    case ReduceOp::kMin: return reduceTyped<T, ReduceOp::kMin>(out, in, n, count);
    case ReduceOp::kMax: return reduceTyped<T, ReduceOp::kMax>(out, in, n, count);
    default: break;
  }
  if constexpr (!kFloat) {
    switch (op) {
      case ReduceOp::kBand: return reduceTyped<T, ReduceOp::kBand>(out, in, n, count);
      case ReduceOp::kBor: return reduceTyped<T, ReduceOp::kBor>(out, in, n, count);
      case ReduceOp::kBxor: return reduceTyped<T, ReduceOp::kBxor>(out, in, n, count);
      default: break;
    }
  }
  TDX_ENFORCE(false, "reduce op ", reduceOpName(op), " is not defined for this dtype");
}

// bool is stored as 0/1 bytes: SUM and MAX are OR, PRODUCT and MIN are AND.
void reduceBool(void* out, const void* const* in, int n, size_t count, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMax:
    case ReduceOp::kBor: return reduceTyped<uint8_t, ReduceOp::kBor>(out, in, n, count);
    case ReduceOp::kProduct:
    case ReduceOp::kMin:
    case ReduceOp::kBand: return reduceTyped<uint8_t, ReduceOp::kBand>(out, in, n, count);
    case ReduceOp::kBxor: return reduceTyped<uint8_t, ReduceOp::kBxor>(out, in, n, count);
    default: TDX_ENFORCE(false, "reduce op ", reduceOpName(op), " is not defined for bool");
  }
}

void reduceIntoImpl(void* out, const void* const* in, int n, size_t count, DataType dt, ReduceOp op) {
  TDX_CHECK_GE(n, 1);
  TDX_ENFORCE(reduceOpSupported(dt, op), "reduce op ", reduceOpName(op), " is not supported for dtype ",
              dataTypeName(dt));
  switch (dt) {
    case DataType::kFloat32: return reduceOpDispatch<float>(out, in, n, count, op);
    case DataType::kFloat64: return reduceOpDispatch<double>(out, in, n, count, op);
    case DataType::kFloat16: return reduceOpDispatch<HalfTag>(out, in, n, count, op);
    case DataType::kBFloat16: return reduceOpDispatch<BFloat16Tag>(out, in, n, count, op);
    case DataType::kInt8: return reduceOpDispatch<int8_t>(out, in, n, count, op);
    case DataType::kInt16: return reduceOpDispatch<int16_t>(out, in, n, count, op);
    case DataType::kInt32: return reduceOpDispatch<int32_t>(out, in, n, count, op);
    case DataType::kInt64: return reduceOpDispatch<int64_t>(out, in, n, count, op);
    case DataType::kUInt8: return reduceOpDispatch<uint8_t>(out, in, n, count, op);
    case DataType::kBool: return reduceBool(out, in, n, count, op);
    case DataType::kBytes: break;
  }
  TDX_ENFORCE(false, "dtype ", dataTypeName(dt), " cannot be reduced");
}

void reduceScaledSumImpl(void* out, const void* const* in, int n, size_t count, DataType dt, double s) {
  TDX_CHECK_GE(n, 1);
  switch (dt) {
    case DataType::kFloat32: return reduceScaledSum<float>(out, in, n, count, s);
    case DataType::kFloat64: return reduceScaledSum<double>(out, in, n, count, s);
    case DataType::kFloat16: return reduceScaledSum<HalfTag>(out, in, n, count, s);
    case DataType::kBFloat16: return reduceScaledSum<BFloat16Tag>(out, in, n, count, s);
    default: break;
  }
  TDX_ENFORCE(false, "a scaled sum (PREMUL_SUM) needs a floating dtype, got ", dataTypeName(dt));
}

}  // namespace TDX_FOLD_NS
}  // namespace tdx
