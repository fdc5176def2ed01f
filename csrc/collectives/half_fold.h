// The fp16 / bf16 fold loop shared by the vector builds: SUM / AVG / scaled SUM (PREMUL_SUM: each
// term times `scale`, rounded to the storage type) of n inputs, accumulated in float left to right
// and rounded once, V::kStep elements per step, then a scalar tail with the same conversions. V
// holds the vector primitives of one ISA: reduce_fold.h's AVX2 + F16C lanes (16 per step) and
// reduce_kernels_avx512.cc's AVX-512 lanes (32). Every input's elements are read before the
// output's are written, so `out` may alias an input exactly.
//
// No include guard and no namespace of its own: it is included inside each build's namespace
// (after <immintrin.h>, under that build's target pragma), so the builds never share a symbol.

enum class HalfFold { kSum, kAvg, kScaled };

// One value, with the shared converter's rules (fp16 through F16C, which gives the same bits).
inline float halfLoad1(bool half, uint16_t v) { return half ? _cvtsh_ss(v) : kernels::bf16ToFloat(v); }
inline uint16_t halfStore1(bool half, float a) {
  return half ? _cvtss_sh(a, _MM_FROUND_TO_NEAREST_INT) : kernels::floatToBf16(a);
}

template <bool kHalf, HalfFold kMode, typename V>
void foldHalfLanes(void* outv, const void* const* inv, int n, size_t count, float scale) {
  using F = typename V::F;
  auto* out = static_cast<uint16_t*>(outv);
  const auto in = [inv](int k) { return static_cast<const uint16_t*>(inv[k]); };
  const float div = static_cast<float>(n);
  const F sv = V::set1(scale);
  const auto term = [&](int k, size_t i, F& lo, F& hi) {
    V::template load<kHalf>(in(k) + i, lo, hi);
    if constexpr (kMode == HalfFold::kScaled) {
      lo = V::template round<kHalf>(V::mul(lo, sv));
      hi = V::template round<kHalf>(V::mul(hi, sv));
    }
  };
  const auto scalarTerm = [&](int k, size_t i) {
    const float v = halfLoad1(kHalf, in(k)[i]);
    return kMode == HalfFold::kScaled ? halfLoad1(kHalf, halfStore1(kHalf, v * scale)) : v;
  };
  size_t i = 0;
  for (; i + V::kStep <= count; i += V::kStep) {
    F a, b;
    term(0, i, a, b);
    for (int k = 1; k < n; ++k) {
      F c, d;
      term(k, i, c, d);
      a = V::add(a, c);
      b = V::add(b, d);
    }
    if constexpr (kMode == HalfFold::kAvg) {
      a = V::div(a, V::set1(div));
      b = V::div(b, V::set1(div));
    }
    V::template store<kHalf>(out + i, a, b);
  }
  for (; i < count; ++i) {
    float a = scalarTerm(0, i);
    for (int k = 1; k < n; ++k) a = a + scalarTerm(k, i);
    out[i] = halfStore1(kHalf, kMode == HalfFold::kAvg ? a / div : a);
  }
}
