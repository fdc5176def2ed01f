// The fused multi-tensor pack/unpack (kernels/pack_cpu.h, i.e. the per-chunk math the CUDA
// kernels share) against an independent element-by-element reference on random layouts:
// outputs are poisoned with NaN / 0xA5 bytes first, so an element that is not written shows up.
#include "kernels/pack_cpu.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

namespace tdx::test {
namespace {

using kernels::PackSpec;

struct Layout {
  std::vector<int64_t> numels;
  int64_t align;
  int64_t divisor;
};

Layout randomLayout(std::mt19937& rng) {
  Layout l;
  const int n = std::uniform_int_distribution<int>(0, 12)(rng);
  for (int i = 0; i < n; ++i) {
    // Mostly small, sometimes empty, sometimes several chunks long.
    const int kind = std::uniform_int_distribution<int>(0, 9)(rng);
    l.numels.push_back(kind == 0 ? 0 : kind == 9 ? std::uniform_int_distribution<int64_t>(1000, 5000)(rng)
                                                  : std::uniform_int_distribution<int64_t>(1, 97)(rng));
  }
  l.align = std::vector<int64_t>{1, 1, 4, 16, 64}[std::uniform_int_distribution<int>(0, 4)(rng)];
  l.divisor = std::uniform_int_distribution<int64_t>(1, 4)(rng);
  return l;
}

// The reference offsets: each entry at the next multiple of align; total padded to divisor.
void refLayout(const Layout& l, std::vector<int64_t>* offsets, int64_t* total) {
  int64_t pos = 0;
  offsets->clear();
  for (int64_t n : l.numels) {
    while (pos % l.align) ++pos;
    offsets->push_back(pos);
    pos += n;
  }
  while (pos % l.divisor) ++pos;
  *total = pos;
}

TEST(PackLayout, PlanMatchesReference) {
  std::mt19937 rng(11);
  for (int iter = 0; iter < 300; ++iter) {
    const Layout l = randomLayout(rng);
    std::vector<int64_t> got, want;
    int64_t gotTotal = -1, wantTotal = -2;
    ASSERT_EQ(kernels::planLayout(l.numels, l.align, l.divisor, &got, &gotTotal), "");
    refLayout(l, &want, &wantTotal);
    ASSERT_EQ(got, want);
    ASSERT_EQ(gotTotal, wantTotal);
    // Every flat element maps to the entry that holds it, or to padding.
    for (int64_t f = 0; f < wantTotal; ++f) {
      int32_t owner = -1;
      for (size_t i = 0; i < want.size(); ++i) {
        if (f >= want[i] && f < want[i] + l.numels[i]) owner = static_cast<int32_t>(i);
      }
      ASSERT_EQ(kernels::findEntry(got.data(), l.numels.data(), static_cast<int32_t>(got.size()), f), owner) << f;
    }
  }
}

TEST(PackLayout, ChunksCoverEveryElementOnce) {
  std::mt19937 rng(12);
  for (int iter = 0; iter < 200; ++iter) {
    const Layout l = randomLayout(rng);
    std::vector<int64_t> offsets;
    int64_t total = 0;
    refLayout(l, &offsets, &total);
    const int64_t chunk = std::uniform_int_distribution<int64_t>(1, 300)(rng);
    std::vector<int> seen(total, 0);
    for (const auto& c : kernels::planChunks(offsets, l.numels, total, chunk, true)) {
      ASSERT_GE(c.count, 1);
      ASSERT_LE(c.count, chunk);
      for (int64_t f = c.flatBegin; f < c.flatBegin + c.count; ++f) {
        ++seen[f];
        ASSERT_EQ(kernels::findEntry(offsets.data(), l.numels.data(), static_cast<int32_t>(offsets.size()), f),
                  c.entry);
      }
    }
    for (int64_t f = 0; f < total; ++f) ASSERT_EQ(seen[f], 1) << "element " << f;
  }
}

TEST(PackLayout, BadLayoutsExplainThemselves) {
  std::vector<int64_t> offsets;
  int64_t total = 0;
  EXPECT_NE(kernels::planLayout({1, 2}, 0, 1, &offsets, &total).find("align"), std::string::npos);
  EXPECT_NE(kernels::planLayout({1, -2}, 1, 1, &offsets, &total).find("negative"), std::string::npos);
  EXPECT_NE(kernels::checkLayout({0, 2}, {4, 4}, 8).find("before the end"), std::string::npos);
  EXPECT_NE(kernels::checkLayout({0, 4}, {4, 4}, 7).find("only 7"), std::string::npos);
  PackSpec s;
  s.offsets = {0};
  s.numels = {4};
  s.total = 4;
  s.elemSize = 2;
  s.floating = true;
  EXPECT_NE(kernels::checkSpec(s).find("float32 and float64"), std::string::npos);
  s.floating = false;
  s.scale = 0.5f;
  EXPECT_NE(kernels::checkSpec(s).find("scale"), std::string::npos);
  std::vector<uint16_t> flat(4);
  EXPECT_THROW(kernels::packCpu(s, {}, flat.data()), std::invalid_argument);
}

template <typename T>
void roundTrip(bool floating, float scale, uint32_t seed) {
  std::mt19937 rng(seed);
  for (int iter = 0; iter < 60; ++iter) {
    const Layout l = randomLayout(rng);
    PackSpec spec;
    spec.numels = l.numels;
    ASSERT_EQ(kernels::planLayout(l.numels, l.align, l.divisor, &spec.offsets, &spec.total), "");
    spec.elemSize = sizeof(T);
    spec.floating = floating;
    spec.scale = scale;
    spec.chunkElems = std::uniform_int_distribution<int64_t>(1, 700)(rng);
    std::vector<std::vector<T>> srcs(l.numels.size());
    std::vector<const void*> srcPtrs;
    for (size_t i = 0; i < srcs.size(); ++i) {
      srcs[i].resize(l.numels[i]);
      for (auto& x : srcs[i]) {
        if constexpr (std::is_floating_point_v<T>) {
          x = static_cast<T>(std::normal_distribution<double>(0, 100)(rng));
        } else {
          x = static_cast<T>(rng());
        }
      }
      srcPtrs.push_back(srcs[i].data());
    }
    // Poisoned output: NaN for floats, 0xA5 bytes otherwise.
    std::vector<T> flat(spec.total);
    if constexpr (std::is_floating_point_v<T>) {
      std::fill(flat.begin(), flat.end(), std::numeric_limits<T>::quiet_NaN());
    } else {
      std::memset(flat.data(), 0xA5, flat.size() * sizeof(T));
    }
    kernels::packCpu(spec, srcPtrs, flat.data());
    // Reference: float64 product rounded once to T (exact for float32 x float32 in double).
    std::vector<char> isData(spec.total, 0);
    for (size_t i = 0; i < srcs.size(); ++i) {
      for (int64_t j = 0; j < l.numels[i]; ++j) {
        isData[spec.offsets[i] + j] = 1;
        T want = srcs[i][j];
        if constexpr (std::is_floating_point_v<T>) {
          if (floating && scale != 1.0f) want = static_cast<T>(static_cast<double>(srcs[i][j]) * scale);
        }
        const T got = flat[spec.offsets[i] + j];
        ASSERT_EQ(std::memcmp(&got, &want, sizeof(T)), 0) << "entry " << i << " element " << j;
      }
    }
    for (int64_t f = 0; f < spec.total; ++f) {
      if (!isData[f]) {
        ASSERT_EQ(flat[f], T(0)) << "padding element " << f << " not zeroed";
      }
    }
    // Unpack into poisoned tensors gives back the flat values.
    std::vector<std::vector<T>> dsts(srcs.size());
    std::vector<void*> dstPtrs;
    for (size_t i = 0; i < dsts.size(); ++i) {
      dsts[i].assign(l.numels[i], T(0));
      std::memset(dsts[i].data(), 0xA5, dsts[i].size() * sizeof(T));
      dstPtrs.push_back(dsts[i].data());
    }
    kernels::unpackCpu(spec, flat.data(), dstPtrs);
    for (size_t i = 0; i < dsts.size(); ++i) {
      ASSERT_EQ(std::memcmp(dsts[i].data(), flat.data() + spec.offsets[i], l.numels[i] * sizeof(T)), 0)
          << "entry " << i;
    }
  }
}

TEST(PackCpu, Float32Unscaled) { roundTrip<float>(true, 1.0f, 21); }
TEST(PackCpu, Float32Scaled) { roundTrip<float>(true, 0.25f, 22); }
TEST(PackCpu, Float32ScaledByThird) { roundTrip<float>(true, 1.0f / 3.0f, 23); }
TEST(PackCpu, Float64Scaled) { roundTrip<double>(true, 1.0f / 3.0f, 24); }
TEST(PackCpu, Raw8) { roundTrip<uint8_t>(false, 1.0f, 25); }
TEST(PackCpu, Raw16) { roundTrip<uint16_t>(false, 1.0f, 26); }
TEST(PackCpu, Raw32) { roundTrip<uint32_t>(false, 1.0f, 27); }
TEST(PackCpu, Raw64) { roundTrip<uint64_t>(false, 1.0f, 28); }

}  // namespace
}  // namespace tdx::test
