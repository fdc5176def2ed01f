// Reference reductions for tests, written independently of collectives/reduce_kernels.cc:
// fp16/bf16 conversions with plain double arithmetic, element loads into double / uint64.
//
// refReduce computes what reduceInto documents: fold left to right in rank order, in the
// accumulator precision (float for fp16/bf16/float32, double for float64, wrapping 2's-complement
// for integers), fp16/bf16 rounded once at the end, AVG = sum / n. refReduce64 folds floats in
// double for a tolerance check of the first.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "collectives/types.h"

namespace tdx::test {

inline float refHalfToFloat(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  double v;
  if (exp == 0) {
    v = std::ldexp(static_cast<double>(man), -24);
  } else if (exp == 31) {
    v = man ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else {
    v = std::ldexp(static_cast<double>(man + 1024), exp - 25);
  }
  return static_cast<float>(sign ? -v : v);
}

inline uint16_t refFloatToHalf(float f) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (std::isnan(f)) return 0x7e00;
  if (std::isinf(f)) return sign | 0x7c00;
  const double a = std::fabs(static_cast<double>(f));
  if (a < std::ldexp(1.0, -14)) {  // subnormal (may round up to the smallest normal, 0x0400)
    return sign | static_cast<uint16_t>(std::nearbyint(std::ldexp(a, 24)));
  }
  int e2;
  std::frexp(a, &e2);  // a = m * 2^e2 with m in [0.5, 1)
  int e = e2 - 1;      // a in [2^e, 2^(e+1))
  double m = std::nearbyint(std::ldexp(a, 10 - e));  // in [1024, 2048]
  if (m == 2048) {
    m = 1024;
    ++e;
  }
  if (e > 15) return sign | 0x7c00;
  return sign | static_cast<uint16_t>(((e + 15) << 10) | (static_cast<int>(m) - 1024));
}

inline float refBf16ToFloat(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t refFloatToBf16(float f) {
  if (std::isnan(f)) return 0x7fc0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t lo = u & 0xffff0000u;
  if (lo == u) return static_cast<uint16_t>(u >> 16);
  // The two bf16 neighbours of f (same sign): the nearer wins, ties go to the even one.
  const uint32_t hi = lo + 0x10000u;
  const double dLo = std::fabs(static_cast<double>(f) - refBf16ToFloat(static_cast<uint16_t>(lo >> 16)));
  const double hiVal = (hi & 0x7fffffffu) >= 0x7f800000u ? std::copysign(std::ldexp(1.0, 128), f)
                                                         : refBf16ToFloat(static_cast<uint16_t>(hi >> 16));
  const double dHi = std::fabs(static_cast<double>(f) - hiVal);
  if (dLo < dHi || (dLo == dHi && ((lo >> 16) & 1) == 0)) return static_cast<uint16_t>(lo >> 16);
  return static_cast<uint16_t>(hi >> 16);
}

inline size_t refElementSize(DataType dt) {
  switch (dt) {
    case DataType::kFloat64:
    case DataType::kInt64: return 8;
    case DataType::kFloat32:
    case DataType::kInt32: return 4;
    case DataType::kFloat16:
    case DataType::kBFloat16:
    case DataType::kInt16: return 2;
    default: return 1;
  }
}

inline bool refIsFloat(DataType dt) {
  return dt == DataType::kFloat32 || dt == DataType::kFloat64 || dt == DataType::kFloat16 ||
         dt == DataType::kBFloat16;
}

// Element i of a float buffer, widened exactly to double.
inline double loadFloat(DataType dt, const void* p, size_t i) {
  const char* b = static_cast<const char*>(p) + i * refElementSize(dt);
  switch (dt) {
    case DataType::kFloat32: { float f; std::memcpy(&f, b, 4); return f; }
    case DataType::kFloat64: { double d; std::memcpy(&d, b, 8); return d; }
    case DataType::kFloat16: { uint16_t h; std::memcpy(&h, b, 2); return refHalfToFloat(h); }
    default: { uint16_t h; std::memcpy(&h, b, 2); return refBf16ToFloat(h); }
  }
}

// Stores v (already a value of the accumulator precision) rounding once to the dtype.
inline void storeFloat(DataType dt, void* p, size_t i, double v) {
  char* b = static_cast<char*>(p) + i * refElementSize(dt);
  switch (dt) {
    case DataType::kFloat32: { float f = static_cast<float>(v); std::memcpy(b, &f, 4); break; }
    case DataType::kFloat64: std::memcpy(b, &v, 8); break;
    case DataType::kFloat16: { uint16_t h = refFloatToHalf(static_cast<float>(v)); std::memcpy(b, &h, 2); break; }
    default: { uint16_t h = refFloatToBf16(static_cast<float>(v)); std::memcpy(b, &h, 2); break; }
  }
}

// Element i of an integer/bool buffer, sign-extended for signed types.
inline uint64_t loadInt(DataType dt, const void* p, size_t i) {
  const char* b = static_cast<const char*>(p) + i * refElementSize(dt);
  switch (dt) {
    case DataType::kInt8: { int8_t v; std::memcpy(&v, b, 1); return static_cast<uint64_t>(static_cast<int64_t>(v)); }
    case DataType::kInt16: { int16_t v; std::memcpy(&v, b, 2); return static_cast<uint64_t>(static_cast<int64_t>(v)); }
    case DataType::kInt32: { int32_t v; std::memcpy(&v, b, 4); return static_cast<uint64_t>(static_cast<int64_t>(v)); }
    case DataType::kInt64: { uint64_t v; std::memcpy(&v, b, 8); return v; }
    default: { uint8_t v; std::memcpy(&v, b, 1); return v; }
  }
}

inline void storeInt(DataType dt, void* p, size_t i, uint64_t v) {  // little-endian truncation
  std::memcpy(static_cast<char*>(p) + i * refElementSize(dt), &v, refElementSize(dt));
}

template <typename A>
A refFoldFloat(A a, A b, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return a + b;
    case ReduceOp::kProduct: return a * b;
    case ReduceOp::kMin: return std::isnan(a) || std::isnan(b) ? std::numeric_limits<A>::quiet_NaN() : (b < a ? b : a);
    default: return std::isnan(a) || std::isnan(b) ? std::numeric_limits<A>::quiet_NaN() : (a < b ? b : a);
  }
}

inline uint64_t refFoldInt(DataType dt, uint64_t a, uint64_t b, ReduceOp op) {
  const bool isSigned = dt != DataType::kUInt8 && dt != DataType::kBool;
  if (dt == DataType::kBool) {
    if (op == ReduceOp::kSum || op == ReduceOp::kMax) op = ReduceOp::kBor;
    if (op == ReduceOp::kProduct || op == ReduceOp::kMin) op = ReduceOp::kBand;
  }
  const bool bLess = isSigned ? static_cast<int64_t>(b) < static_cast<int64_t>(a) : b < a;
  switch (op) {
    case ReduceOp::kSum: return a + b;
    case ReduceOp::kProduct: return a * b;
    case ReduceOp::kMin: return bLess ? b : a;
    case ReduceOp::kMax: return bLess || a == b ? a : b;
    case ReduceOp::kBand: return a & b;
    case ReduceOp::kBor: return a | b;
    default: return a ^ b;
  }
}

// The exact bytes reduceInto must produce for `count` elements of n inputs.
inline std::vector<char> refReduce(const std::vector<const void*>& in, size_t count, DataType dt, ReduceOp op) {
  const int n = static_cast<int>(in.size());
  std::vector<char> out(count * refElementSize(dt));
  for (size_t i = 0; i < count; ++i) {
    if (!refIsFloat(dt)) {
      uint64_t acc = loadInt(dt, in[0], i);
      for (int k = 1; k < n; ++k) acc = refFoldInt(dt, acc, loadInt(dt, in[k], i), op);
      storeInt(dt, out.data(), i, acc);
    } else if (dt == DataType::kFloat64) {
      double acc = loadFloat(dt, in[0], i);
      for (int k = 1; k < n; ++k) acc = refFoldFloat<double>(acc, loadFloat(dt, in[k], i), op);
      if (op == ReduceOp::kAvg) acc /= n;
      storeFloat(dt, out.data(), i, acc);
    } else {
      float acc = static_cast<float>(loadFloat(dt, in[0], i));
      for (int k = 1; k < n; ++k) acc = refFoldFloat<float>(acc, static_cast<float>(loadFloat(dt, in[k], i)), op);
      if (op == ReduceOp::kAvg) acc /= static_cast<float>(n);
      storeFloat(dt, out.data(), i, acc);
    }
  }
  return out;
}

// Float reduction of element i in double precision (for tolerance checks).
inline double refReduce64(const std::vector<const void*>& in, size_t i, DataType dt, ReduceOp op) {
  double acc = loadFloat(dt, in[0], i);
  for (size_t k = 1; k < in.size(); ++k) acc = refFoldFloat<double>(acc, loadFloat(dt, in[k], i), op);
  return op == ReduceOp::kAvg ? acc / static_cast<double>(in.size()) : acc;
}

// `count` random elements of dtype dt: floats in [-lim, lim] (exactly representable), integers
// over their whole range, bools 0/1.
inline std::vector<char> randomElements(DataType dt, size_t count, uint64_t seed, double lim = 2.0) {
  std::mt19937_64 rng(seed);
  std::vector<char> v(count * refElementSize(dt));
  std::uniform_real_distribution<double> uni(-lim, lim);
  for (size_t i = 0; i < count; ++i) {
    if (refIsFloat(dt)) {
      double x = uni(rng);
      storeFloat(dt, v.data(), i, dt == DataType::kFloat64 ? x : static_cast<float>(x));
    } else if (dt == DataType::kBool) {
      v[i] = static_cast<char>(rng() & 1);
    } else {
      storeInt(dt, v.data(), i, rng());
    }
  }
  return v;
}

}  // namespace tdx::test
