// reduceInto and the fp16/bf16 conversions, against the independent references of
// reduce_reference.h: every dtype x op, poisoned outputs, aliasing, NaN, rounding, AVG.
#include "collectives/reduce_kernels.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/logging.h"
#include "reduce_reference.h"

namespace tdx {
namespace fold_generic {  // the two builds of collectives/reduce_fold.h
void reduceIntoImpl(void* out, const void* const* in, int n, size_t count, DataType dt, ReduceOp op);
void reduceScaledSumImpl(void* out, const void* const* in, int n, size_t count, DataType dt, double s);
}  // namespace fold_generic
namespace fold_avx2 {
bool usable();
void reduceIntoImpl(void* out, const void* const* in, int n, size_t count, DataType dt, ReduceOp op);
void reduceScaledSumImpl(void* out, const void* const* in, int n, size_t count, DataType dt, double s);
}  // namespace fold_avx2
namespace fold_avx512 {  // fp16 / bf16 SUM, AVG and scaled SUM only
bool usable();
bool foldHalf(void* out, const void* const* in, int n, size_t count, DataType dt, int mode, float scale);
}  // namespace fold_avx512
}  // namespace tdx

namespace tdx::test {
namespace {

bool halfIsNan(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff); }

TEST(Conversions, HalfToFloatExhaustive) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float got = halfToFloat(static_cast<uint16_t>(h)), want = refHalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << std::hex << h;
    } else {
      ASSERT_EQ(std::memcmp(&got, &want, 4), 0) << std::hex << h << ": got " << got << " want " << want;
    }
  }
}

// Every finite half value, the midpoints between neighbours and one float ulp either side of
// them (where round-to-nearest-even matters), special values, and random float bit patterns.
std::vector<float> conversionProbes() {
  std::vector<float> v = {0.0f, -0.0f, 1.0f, 65504.0f, 65519.99f, 65520.0f, 1e9f, 3.4e38f,
                          std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::denorm_min(), 5.96e-8f, 2.98e-8f, 2.99e-8f, 6.1e-5f};
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    const float a = refHalfToFloat(static_cast<uint16_t>(h)), b = refHalfToFloat(static_cast<uint16_t>(h + 1));
    const float mid = static_cast<float>((static_cast<double>(a) + b) / 2);
    for (float x : {a, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f)}) {
      v.push_back(x);
      v.push_back(-x);
    }
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t u = rng();
    float f;
    std::memcpy(&f, &u, 4);
    v.push_back(f);
  }
  return v;
}

TEST(Conversions, FloatToHalfRoundsToNearestEven) {
  for (float f : conversionProbes()) {
    const uint16_t got = floatToHalf(f), want = refFloatToHalf(f);
    if (std::isnan(f)) {
      ASSERT_TRUE(halfIsNan(got)) << std::hex << got;
    } else {
      ASSERT_EQ(got, want) << f << ": got 0x" << std::hex << got << " want 0x" << want;
    }
  }
}

TEST(Conversions, Bfloat16RoundsToNearestEven) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float got = bfloat16ToFloat(static_cast<uint16_t>(b)), want = refBf16ToFloat(static_cast<uint16_t>(b));
    ASSERT_TRUE(std::memcmp(&got, &want, 4) == 0 || (std::isnan(got) && std::isnan(want))) << b;
  }
  for (float f : conversionProbes()) {
    const uint16_t got = floatToBfloat16(f), want = refFloatToBf16(f);
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(refBf16ToFloat(got))) << std::hex << got;
    } else {
      ASSERT_EQ(got, want) << f << ": got 0x" << std::hex << got << " want 0x" << want;
    }
  }
}

// Compares `count` elements of got and want; NaN equals NaN, everything else bit for bit.
::testing::AssertionResult sameElements(DataType dt, const char* got, const char* want, size_t count) {
  const size_t es = refElementSize(dt);
  for (size_t i = 0; i < count; ++i) {
    if (std::memcmp(got + i * es, want + i * es, es) == 0) continue;
    if (refIsFloat(dt) && std::isnan(loadFloat(dt, got, i)) && std::isnan(loadFloat(dt, want, i))) continue;
    auto failure = ::testing::AssertionFailure() << dataTypeName(dt) << " element " << i << " of " << count;
    if (refIsFloat(dt)) {
      failure << ": got " << loadFloat(dt, got, i) << " want " << loadFloat(dt, want, i);
    } else {
      failure << ": got " << static_cast<int64_t>(loadInt(dt, got, i)) << " want "
              << static_cast<int64_t>(loadInt(dt, want, i));
    }
    return failure;
  }
  return ::testing::AssertionSuccess();
}

const DataType kAllTypes[] = {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16, DataType::kBFloat16,
                              DataType::kInt8,    DataType::kInt16,   DataType::kInt32,   DataType::kInt64,
                              DataType::kUInt8,   DataType::kBool};
const ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kProduct, ReduceOp::kMin,
                            ReduceOp::kMax, ReduceOp::kBand, ReduceOp::kBor, ReduceOp::kBxor};

std::vector<std::tuple<DataType, ReduceOp>> supportedCombos() {
  std::vector<std::tuple<DataType, ReduceOp>> v;
  for (DataType dt : kAllTypes) {
    for (ReduceOp op : kAllOps) {
      if (reduceOpSupported(dt, op)) v.emplace_back(dt, op);
    }
  }
  return v;
}

class ReduceKernel : public ::testing::TestWithParam<std::tuple<DataType, ReduceOp>> {};

TEST_P(ReduceKernel, MatchesReferenceForEveryCountAndRankCount) {
  const auto [dt, op] = GetParam();
  const size_t es = elementSize(dt);
  ASSERT_EQ(es, refElementSize(dt));
  constexpr size_t kGuard = 64;  // bytes after the output that must stay poisoned
  uint64_t seed = 1;
  for (int n : {1, 2, 3, 4, 7, 8, 9}) {  // 8: the last unrolled count; 9: the blocked loop
    for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{511}, size_t{512}, size_t{513}, size_t{1037}}) {
      std::vector<std::vector<char>> data;
      std::vector<const void*> in;
      for (int k = 0; k < n; ++k) data.push_back(randomElements(dt, count, seed++));
      for (auto& d : data) in.push_back(d.data());
      const std::vector<char> want = refReduce(in, count, dt, op);

      std::vector<char> out(count * es + kGuard, static_cast<char>(0xFF));
      reduceInto(out.data(), in.data(), n, count, dt, op);
      ASSERT_TRUE(sameElements(dt, out.data(), want.data(), count)) << "n=" << n << " count=" << count;
      for (size_t b = count * es; b < out.size(); ++b) {
        ASSERT_EQ(static_cast<unsigned char>(out[b]), 0xFFu) << "wrote past the end, n=" << n << " count=" << count;
      }
      if (refIsFloat(dt)) {  // the documented fold is also close to the exact (float64) result
        const double eps = dt == DataType::kFloat64 ? 0x1p-52 : dt == DataType::kFloat32 ? 0x1p-23
                                                     : dt == DataType::kFloat16         ? 0x1p-10
                                                                                        : 0x1p-7;
        for (size_t i = 0; i < count; ++i) {
          double mag = 0;
          for (auto* p : in) mag += std::fabs(loadFloat(dt, p, i));
          if (op == ReduceOp::kProduct || op == ReduceOp::kMin || op == ReduceOp::kMax) {
            mag = std::fabs(refReduce64(in, i, dt, op));
          }
          const double ref = refReduce64(in, i, dt, op), got = loadFloat(dt, out.data(), i);
          const double subnormal = dt == DataType::kFloat16 ? 0x1p-24 : 0x1p-133;
          ASSERT_LE(std::fabs(got - ref), (n + 1) * 0x1p-23 * mag + eps * std::fabs(ref) + subnormal)
              << "element " << i << " n=" << n;
        }
      }
      // In place: the output may alias any input (the collectives alias their own rank's).
      for (int alias : {0, n - 1}) {
        std::vector<char> copy = data[alias];
        std::vector<const void*> in2 = in;
        in2[alias] = copy.data();
        reduceInto(copy.data(), in2.data(), n, count, dt, op);
        ASSERT_TRUE(sameElements(dt, copy.data(), want.data(), count)) << "aliased input " << alias;
      }
    }
  }
}

std::string comboName(const ::testing::TestParamInfo<std::tuple<DataType, ReduceOp>>& info) {
  return std::string(dataTypeName(std::get<0>(info.param))) + "_" + reduceOpName(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(AllTypesAndOps, ReduceKernel, ::testing::ValuesIn(supportedCombos()), comboName);

TEST(ReduceKernels, EveryCombinationIsEitherSupportedOrAClearError) {
  int supported = 0;
  for (DataType dt : kAllTypes) {
    for (ReduceOp op : kAllOps) {
      if (reduceOpSupported(dt, op)) {
        ++supported;
        continue;
      }
      char a[8] = {}, b[8] = {}, out[8];
      const void* in[2] = {a, b};
      try {
        reduceInto(out, in, 2, 1, dt, op);
        ADD_FAILURE() << reduceOpName(op) << " on " << dataTypeName(dt) << " did not throw";
      } catch (const Error& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find(reduceOpName(op)), std::string::npos) << msg;
        EXPECT_NE(msg.find(dataTypeName(dt)), std::string::npos) << msg;
      }
    }
  }
  // Floats: SUM AVG PRODUCT MIN MAX. Integers and bool: all but AVG.
  EXPECT_EQ(supported, 4 * 5 + 6 * 7);
  char a[8] = {}, out[8];
  const void* in[1] = {a};
  EXPECT_THROW(reduceInto(out, in, 1, 1, DataType::kBytes, ReduceOp::kSum), Error);
}

TEST(ReduceKernels, MinMaxPropagateNaN) {
  for (DataType dt : {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16, DataType::kBFloat16}) {
    for (ReduceOp op : {ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kSum}) {
      constexpr int n = 4;
      constexpr size_t count = 600;
      std::vector<std::vector<char>> data;
      std::vector<const void*> in;
      for (int k = 0; k < n; ++k) data.push_back(randomElements(dt, count, 100 + k));
      // Element i holds a NaN on rank i % (n + 1) (none when i % (n + 1) == n).
      for (size_t i = 0; i < count; ++i) {
        if (i % (n + 1) != n) storeFloat(dt, data[i % (n + 1)].data(), i, std::numeric_limits<double>::quiet_NaN());
      }
      for (auto& d : data) in.push_back(d.data());
      std::vector<char> out(count * elementSize(dt), static_cast<char>(0xFF));
      reduceInto(out.data(), in.data(), n, count, dt, op);
      for (size_t i = 0; i < count; ++i) {
        const double got = loadFloat(dt, out.data(), i);
        if (i % (n + 1) != n) {
          ASSERT_TRUE(std::isnan(got)) << dataTypeName(dt) << " " << reduceOpName(op) << " element " << i;
        } else {
          ASSERT_FALSE(std::isnan(got)) << dataTypeName(dt) << " " << reduceOpName(op) << " element " << i;
          ASSERT_EQ(got, loadFloat(dt, refReduce(in, count, dt, op).data(), i));
        }
      }
    }
  }
}

TEST(ReduceKernels, HalfPrecisionAccumulatesInFloatAndRoundsOnce) {
  // 1 + 2^-11 + 2^-11 in fp16: rounding after every step gives 1 (ties to even twice); the
  // float accumulator gives 1 + 2^-10, which fp16 represents exactly.
  for (DataType dt : {DataType::kFloat16, DataType::kBFloat16}) {
    const double tiny = dt == DataType::kFloat16 ? 0x1p-11 : 0x1p-8;
    std::vector<char> a(2), b(2), c(2), out(2);
    storeFloat(dt, a.data(), 0, 1.0);
    storeFloat(dt, b.data(), 0, tiny);
    storeFloat(dt, c.data(), 0, tiny);
    const void* in[3] = {a.data(), b.data(), c.data()};
    reduceInto(out.data(), in, 3, 1, dt, ReduceOp::kSum);
    EXPECT_EQ(loadFloat(dt, out.data(), 0), 1.0 + 2 * tiny) << dataTypeName(dt);
    // AVG divides the float sum once: (1 + 2t) / 3 rounded once.
    reduceInto(out.data(), in, 3, 1, dt, ReduceOp::kAvg);
    std::vector<char> want(2);
    storeFloat(dt, want.data(), 0, static_cast<float>(1.0f + static_cast<float>(2 * tiny)) / 3.0f);
    EXPECT_EQ(std::memcmp(out.data(), want.data(), 2), 0) << dataTypeName(dt);
  }
}

TEST(ReduceKernels, ScaledSumRoundsEachProductToTheDtype) {
  // The bits of multiplying every input by s in the dtype first, then summing in rank order.
  const float a[3] = {1.0f, 0.1f, -7.25f}, b[3] = {2.0f, 0.2f, 3.0f}, c[3] = {1e-30f, 0.7f, 1e30f};
  const double s = 1.0 / 3.0;
  const float sf = static_cast<float>(s);
  float out[3] = {-1.0f, -1.0f, -1.0f};
  const void* in[3] = {a, b, c};
  reduceScaledSumInto(out, in, 3, 3, DataType::kFloat32, s);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(out[i], (a[i] * sf + b[i] * sf) + c[i] * sf) << i;
  const double d[2] = {0.1, 0.3}, e[2] = {0.2, -0.3};
  double outd[2];
  const void* ind[2] = {d, e};
  reduceScaledSumInto(outd, ind, 2, 2, DataType::kFloat64, s);
  for (int i = 0; i < 2; ++i) EXPECT_EQ(outd[i], d[i] * s + e[i] * s) << i;
  // fp16/bf16: each product is rounded to the dtype, then the float sum is rounded once.
  for (DataType dt : {DataType::kFloat16, DataType::kBFloat16}) {
    std::vector<char> x(2), y(2), out16(2, 0x7f), want(2), px(2), py(2);
    storeFloat(dt, x.data(), 0, 1.0 + (dt == DataType::kFloat16 ? 0x1p-10 : 0x1p-7));
    storeFloat(dt, y.data(), 0, 3.0);
    const void* in16[2] = {x.data(), y.data()};
    reduceScaledSumInto(out16.data(), in16, 2, 1, dt, s);
    storeFloat(dt, px.data(), 0, static_cast<float>(loadFloat(dt, x.data(), 0)) * sf);
    storeFloat(dt, py.data(), 0, static_cast<float>(loadFloat(dt, y.data(), 0)) * sf);
    storeFloat(dt, want.data(), 0,
               static_cast<float>(loadFloat(dt, px.data(), 0)) + static_cast<float>(loadFloat(dt, py.data(), 0)));
    EXPECT_EQ(std::memcmp(out16.data(), want.data(), 2), 0) << dataTypeName(dt);
  }
  int32_t ints[1] = {1};
  const void* ini[1] = {ints};
  EXPECT_THROW(reduceScaledSumInto(ints, ini, 1, 1, DataType::kInt32, s), std::exception);
}

TEST(ReduceKernels, ScaledSumOfManyInputsMatchesTheScalarFoldInPlaceToo) {
  // 1-8 inputs take the unrolled single pass, 9 the blocked loop; every count, and the output
  // aliasing the first or the last input (the collectives fold their own rank's slice in place).
  const double s = 0.1;
  const float sf = static_cast<float>(s);
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> dist(-100.0f, 100.0f);
  for (int n = 1; n <= 9; ++n) {
    for (size_t count : {size_t{0}, size_t{1}, size_t{15}, size_t{513}, size_t{1037}}) {
      std::vector<std::vector<float>> data(n, std::vector<float>(count));
      for (auto& v : data) {
        for (auto& x : v) x = dist(gen);
      }
      std::vector<float> want(count);
      for (size_t i = 0; i < count; ++i) {
        float acc = data[0][i] * sf;
        for (int k = 1; k < n; ++k) acc = acc + data[k][i] * sf;
        want[i] = acc;
      }
      for (int alias : {-1, 0, n - 1}) {
        std::vector<std::vector<float>> copy = data;
        std::vector<const void*> in;
        for (auto& v : copy) in.push_back(v.data());
        std::vector<float> fresh(count + 4, -1.0f);
        float* out = alias < 0 ? fresh.data() : copy[alias].data();
        reduceScaledSumInto(out, in.data(), n, count, DataType::kFloat32, s);
        ASSERT_EQ(std::memcmp(out, want.data(), count * sizeof(float)), 0)
            << "n=" << n << " count=" << count << " alias=" << alias;
        if (alias < 0) {
          for (size_t i = count; i < count + 4; ++i) ASSERT_EQ(fresh[i], -1.0f) << "wrote past the output";
        }
      }
    }
  }
}

TEST(ReduceKernels, AvgOfFloatsAndIntegerWraparound) {
  const float a[3] = {1.0f, -3.0f, 0.5f}, b[3] = {2.0f, 3.0f, 0.25f}, c[3] = {4.0f, 9.0f, 0.0f};
  float out[3];
  const void* in[3] = {a, b, c};
  reduceInto(out, in, 3, 3, DataType::kFloat32, ReduceOp::kAvg);
  EXPECT_EQ(out[0], 7.0f / 3.0f);
  EXPECT_EQ(out[1], 3.0f);
  EXPECT_EQ(out[2], 0.25f);

  const int8_t x[2] = {100, -128}, y[2] = {100, -1};
  int8_t s[2];
  const void* in8[2] = {x, y};
  reduceInto(s, in8, 2, 2, DataType::kInt8, ReduceOp::kSum);
  EXPECT_EQ(s[0], static_cast<int8_t>(-56));
  EXPECT_EQ(s[1], static_cast<int8_t>(127));
  reduceInto(s, in8, 2, 2, DataType::kInt8, ReduceOp::kMin);
  EXPECT_EQ(s[0], 100);
  EXPECT_EQ(s[1], -128);
  const int64_t big[2] = {std::numeric_limits<int64_t>::max(), -5}, one[2] = {1, 3};
  int64_t r[2];
  const void* in64[2] = {big, one};
  reduceInto(r, in64, 2, 2, DataType::kInt64, ReduceOp::kSum);
  EXPECT_EQ(r[0], std::numeric_limits<int64_t>::min());
  reduceInto(r, in64, 2, 2, DataType::kInt64, ReduceOp::kMax);
  EXPECT_EQ(r[0], std::numeric_limits<int64_t>::max());
  EXPECT_EQ(r[1], 3);
}

// The AVX2 + F16C build of the folds and the baseline build give the same bits for every dtype, op,
// input count and every 16-bit pattern (a NaN equals a NaN: where two NaNs meet, which payload wins
// depends on the operand order the compiler picked): ranks whose CPUs differ still agree, and the
// F16C conversions follow the shared converter's rules.
TEST(ReduceKernels, Avx2BuildMatchesGenericBitForBit) {
  if (!tdx::fold_avx2::usable()) GTEST_SKIP() << "this CPU has no AVX2 + F16C";
  std::mt19937 rng(11);
  const size_t count = 70000;  // not a multiple of any vector width; covers all 65536 patterns below
  for (DataType dt : {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16, DataType::kBFloat16,
                      DataType::kInt8, DataType::kInt32, DataType::kInt64, DataType::kUInt8, DataType::kBool}) {
    const size_t es = elementSize(dt);
    for (int n : {1, 2, 3, 9}) {
      std::vector<std::vector<char>> bufs(n, std::vector<char>(count * es));
      std::vector<const void*> in(n);
      for (int k = 0; k < n; ++k) {
        for (size_t i = 0; i < bufs[k].size(); ++i) bufs[k][i] = static_cast<char>(rng());
        if (es == 2 && k == 0) {
          for (size_t i = 0; i < 65536; ++i) std::memcpy(&bufs[k][2 * i], &i, 2);  // every pattern
        }
        if (dt == DataType::kBool) {
          for (auto& c : bufs[k]) c &= 1;
        }
        in[k] = bufs[k].data();
      }
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax,
                          ReduceOp::kBand, ReduceOp::kBor, ReduceOp::kBxor}) {
        if (!reduceOpSupported(dt, op)) continue;
        std::vector<char> a(count * es), b(count * es);
        tdx::fold_generic::reduceIntoImpl(a.data(), in.data(), n, count, dt, op);
        tdx::fold_avx2::reduceIntoImpl(b.data(), in.data(), n, count, dt, op);
        ASSERT_TRUE(sameElements(dt, b.data(), a.data(), count)) << reduceOpName(op) << " n=" << n;
      }
      // A scale that overflows fp16 too (the products round to infinity before the sum).
      for (double scale : {0.37, 1e4}) {
        if (!isFloating(dt)) break;
        std::vector<char> a(count * es), b(count * es);
        tdx::fold_generic::reduceScaledSumImpl(a.data(), in.data(), n, count, dt, scale);
        tdx::fold_avx2::reduceScaledSumImpl(b.data(), in.data(), n, count, dt, scale);
        ASSERT_TRUE(sameElements(dt, b.data(), a.data(), count)) << "scaled by " << scale << " n=" << n;
      }
    }
  }
}

// The AVX-512 fp16 / bf16 folds (32 elements per step) give the baseline build's bits for SUM, AVG
// and scaled SUM, every input count below and every 16-bit pattern, the scalar tail included.
TEST(ReduceKernels, Avx512HalfFoldsMatchGenericBitForBit) {
  if (!tdx::fold_avx512::usable()) GTEST_SKIP() << "this CPU has no AVX-512 F + BW (or TDX_REDUCE_ISA says no)";
  std::mt19937 rng(12);
  const size_t count = 70001;  // a tail after the last full step of 32
  for (DataType dt : {DataType::kFloat16, DataType::kBFloat16}) {
    for (int n : {1, 2, 3, 9}) {
      std::vector<std::vector<uint16_t>> bufs(n, std::vector<uint16_t>(count));
      std::vector<const void*> in(n);
      for (int k = 0; k < n; ++k) {
        for (auto& v : bufs[k]) v = static_cast<uint16_t>(rng());
        if (k == 0) {
          for (size_t i = 0; i < 65536; ++i) bufs[k][i] = static_cast<uint16_t>(i);  // every pattern
        }
        in[k] = bufs[k].data();
      }
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
        std::vector<uint16_t> a(count), b(count);
        tdx::fold_generic::reduceIntoImpl(a.data(), in.data(), n, count, dt, op);
        ASSERT_TRUE(tdx::fold_avx512::foldHalf(b.data(), in.data(), n, count, dt, op == ReduceOp::kAvg ? 1 : 0, 1.0f));
        ASSERT_TRUE(sameElements(dt, reinterpret_cast<const char*>(b.data()), reinterpret_cast<const char*>(a.data()), count)) << reduceOpName(op) << " n=" << n;
      }
      for (double scale : {0.37, 1e4}) {
        std::vector<uint16_t> a(count), b(count);
        tdx::fold_generic::reduceScaledSumImpl(a.data(), in.data(), n, count, dt, scale);
        ASSERT_TRUE(tdx::fold_avx512::foldHalf(b.data(), in.data(), n, count, dt, 2, static_cast<float>(scale)));
        ASSERT_TRUE(sameElements(dt, reinterpret_cast<const char*>(b.data()), reinterpret_cast<const char*>(a.data()), count)) << "scaled by " << scale << " n=" << n;
      }
    }
  }
}

}  // namespace
}  // namespace tdx::test
