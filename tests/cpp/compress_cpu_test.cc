// The compression loops of csrc/kernels/compress_cpu.cc (and so the element math of
// compress_math.h that the CUDA kernels share) against independent double-precision references
// (reduce_reference.h for fp16/bf16), on random data with poisoned outputs.
#include "kernels/compress_cpu.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "reduce_reference.h"

namespace tdx::test {
namespace {

using namespace tdx::kernels;

std::vector<float> randomData(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(gen);
  return v;
}

// Probes where rounding matters: random bit patterns, specials, fp16 range edges.
std::vector<float> probes() {
  std::vector<float> v = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65519.99f, 65520.0f, -65520.0f, 1e9f, 3.4e38f,
                          std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::denorm_min(), 5.96e-8f, 2.98e-8f, 2.99e-8f, 6.1e-5f,
                          std::numeric_limits<float>::max()};
  std::mt19937 gen(7);
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = gen();
    float f;
    std::memcpy(&f, &u, 4);
    if (!std::isnan(f)) v.push_back(f);
  }
  return v;
}

TEST(CompressCpu, Bf16RoundTripMatchesReference) {
  auto in = probes();
  in.push_back(std::numeric_limits<float>::quiet_NaN());
  const int64_t n = static_cast<int64_t>(in.size());
  std::vector<uint16_t> c(in.size(), 0xAAAA);
  std::vector<float> back(in.size(), std::numeric_limits<float>::quiet_NaN());
  bf16Compress(in.data(), c.data(), n);
  bf16Decompress(c.data(), back.data(), n);
  for (size_t i = 0; i < in.size(); ++i) {
    if (std::isnan(in[i])) {
      ASSERT_TRUE(std::isnan(back[i])) << i;
      ASSERT_TRUE(c[i] & 0x0040) << "NaN must stay quiet";
      continue;
    }
    ASSERT_EQ(c[i], refFloatToBf16(in[i])) << "x=" << in[i];
    const float want = refBf16ToFloat(c[i]);
    ASSERT_EQ(std::memcmp(&back[i], &want, 4), 0) << i;
  }
}

TEST(CompressCpu, Fp16RoundTripMatchesReference) {
  auto in = probes();
  in.push_back(std::numeric_limits<float>::quiet_NaN());
  const int64_t n = static_cast<int64_t>(in.size());
  std::vector<uint16_t> c(in.size(), 0xAAAA);
  std::vector<float> back(in.size(), std::numeric_limits<float>::quiet_NaN());
  fp16Compress(in.data(), c.data(), n);
  fp16Decompress(c.data(), back.data(), n);
  for (size_t i = 0; i < in.size(); ++i) {
    if (std::isnan(in[i])) {
      ASSERT_TRUE((c[i] & 0x7C00) == 0x7C00 && (c[i] & 0x3FF)) << "NaN must stay NaN";
      ASSERT_TRUE(std::isnan(back[i]));
      continue;
    }
    ASSERT_EQ(c[i], refFloatToHalf(in[i])) << "x=" << in[i];
    const float want = refHalfToFloat(c[i]);
    ASSERT_EQ(std::memcmp(&back[i], &want, 4), 0) << i;
  }
}

TEST(CompressCpu, HalfToFloatExhaustive) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float got = halfToFloat(static_cast<uint16_t>(h)), want = refHalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << h;
    } else {
      ASSERT_EQ(std::memcmp(&got, &want, 4), 0) << h;
      if (!std::isinf(want)) ASSERT_EQ(floatToHalf(got), h) << "round trip of " << h;
    }
  }
}

TEST(CompressCpu, Int8BlockwiseWithinHalfAStep) {
  for (int block : {1, 7, 256}) {
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{255}, int64_t{256}, int64_t{257}, int64_t{5000}}) {
      auto in = randomData(n, static_cast<uint32_t>(n * 31 + block), 3.0f);
      if (n > 300) std::fill(in.begin() + 256, in.begin() + 300, 0.0f);  // an all-zero region
      const int64_t nb = int8NumBlocks(n, block);
      std::vector<int8_t> q(static_cast<size_t>(n), int8_t{-128});  // poisoned: never a valid output
      std::vector<float> scales(static_cast<size_t>(nb), std::numeric_limits<float>::quiet_NaN());
      std::vector<float> back(static_cast<size_t>(n), std::numeric_limits<float>::quiet_NaN());
      int8BlockQuantize(in.data(), n, block, q.data(), scales.data());
      int8BlockDequantize(q.data(), scales.data(), n, block, back.data());
      for (int64_t b = 0; b < nb; ++b) {
        double absmax = 0;
        for (int64_t i = b * block; i < std::min<int64_t>(n, (b + 1) * block); ++i)
          absmax = std::max(absmax, std::fabs(static_cast<double>(in[i])));
        ASSERT_NEAR(scales[b], absmax / 127.0, absmax / 127.0 * 1e-6) << "block " << b;
        for (int64_t i = b * block; i < std::min<int64_t>(n, (b + 1) * block); ++i) {
          ASSERT_GE(q[i], -127);
          ASSERT_LE(q[i], 127);
          const double s = scales[b];
          if (s == 0) {
            ASSERT_EQ(q[i], 0);
            ASSERT_EQ(back[i], 0.0f);
            continue;
          }
          const double ref = std::nearbyint(static_cast<double>(in[i]) / s);
          ASSERT_LE(std::fabs(q[i] - ref), 1.0) << i;  // float division may tip an exact tie
          ASSERT_LE(std::fabs(static_cast<double>(back[i]) - in[i]), s * 0.5 * (1 + 1e-5) + 1e-30) << i;
          if (std::fabs(in[i]) == absmax) ASSERT_EQ(std::abs(q[i]), 127) << "the block max maps to +-127";
        }
      }
      // DequantizeAdd accumulates the same values.
      std::vector<float> acc(static_cast<size_t>(n), 1.0f);
      int8BlockDequantizeAdd(q.data(), scales.data(), n, block, acc.data());
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(acc[i], 1.0f + back[i]) << i;
    }
  }
}

TEST(CompressCpu, Int8NanQuantizesToZeroWithNanScale) {
  std::vector<float> in = {1.0f, std::numeric_limits<float>::quiet_NaN(), -2.0f, 0.5f};
  std::vector<int8_t> q(4, int8_t{-128});
  std::vector<float> s(2, 0.0f);
  int8BlockQuantize(in.data(), 4, 2, q.data(), s.data());
  EXPECT_TRUE(std::isnan(s[0]));
  EXPECT_EQ(q[0], 0);
  EXPECT_EQ(q[1], 0);
  EXPECT_FLOAT_EQ(s[1], 2.0f / 127.0f);
  EXPECT_EQ(q[2], -127);
  EXPECT_EQ(q[3], static_cast<int8_t>(std::nearbyint(0.5 * 127 / 2.0)));
}

TEST(CompressCpu, TopkSelectsLargestMagnitudesInIndexOrder) {
  for (int64_t n : {int64_t{1}, int64_t{10}, int64_t{1000}}) {
    auto in = randomData(n, static_cast<uint32_t>(n));
    if (n >= 10) in[3] = in[5] = 100.0f;  // ties
    for (int64_t k : {int64_t{0}, int64_t{1}, n / 10, n}) {
      std::vector<int64_t> idx(static_cast<size_t>(k) + 1, -7);
      std::vector<float> val(static_cast<size_t>(k) + 1, std::numeric_limits<float>::quiet_NaN());
      topkSelect(in.data(), n, k, idx.data(), val.data());
      // Reference: sort by (|x| desc, index asc) in double.
      std::vector<int64_t> order(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) order[i] = i;
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
        return std::fabs(static_cast<double>(in[a])) > std::fabs(static_cast<double>(in[b]));
      });
      std::vector<int64_t> want(order.begin(), order.begin() + k);
      std::sort(want.begin(), want.end());
      for (int64_t j = 0; j < k; ++j) {
        ASSERT_EQ(idx[j], want[j]) << "n=" << n << " k=" << k << " j=" << j;
        ASSERT_EQ(val[j], in[want[j]]);
      }
      ASSERT_EQ(idx[k], -7) << "wrote past k";
      std::vector<float> out(static_cast<size_t>(n), 0.5f);
      scatterAdd(idx.data(), val.data(), k, out.data());
      for (int64_t j = 0; j < k; ++j) ASSERT_EQ(out[idx[j]], 0.5f + in[idx[j]]);
    }
  }
}

}  // namespace
}  // namespace tdx::test
