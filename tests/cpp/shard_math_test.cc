#include "sharding/shard_math.h"

#include <gtest/gtest.h>

#include <numeric>

#include "common/logging.h"
#include "sharding/flat_layout.h"

namespace tdx {
namespace {

FlatLayout layout(std::vector<int64_t> numels, int64_t align, int64_t world) {
  return makeFlatLayout(numels, FlatLayoutOptions{align, world});
}

TEST(FlatLayout, OffsetsAreAlignedAndPaddingDividesWorld) {
  FlatLayout l = layout({5, 3, 8}, 4, 3);
  EXPECT_EQ(l.offsets, (std::vector<int64_t>{0, 8, 12}));
  EXPECT_EQ(l.unpaddedNumel, 20);
  EXPECT_EQ(l.paddedNumel, 24);  // multiple of 3 * 4
  EXPECT_EQ(l.shardNumel, 8);
}

TEST(FlatLayout, InteriorOffsetsDoNotDependOnWorldSize) {
  for (int64_t w = 1; w <= 7; ++w) {
    FlatLayout l = layout({7, 1, 13, 2}, 4, w);
    EXPECT_EQ(l.offsets, (std::vector<int64_t>{0, 8, 12, 28}));
    EXPECT_EQ(l.paddedNumel % (w * 4), 0);
    EXPECT_GE(l.paddedNumel, l.unpaddedNumel);
    EXPECT_LT(l.paddedNumel - l.unpaddedNumel, w * 4);
  }
}

TEST(FlatLayout, SplitSizesCoverTheBufferWithParamsAtEvenIndices) {
  FlatLayout l = layout({5, 3, 8}, 4, 3);
  std::vector<int64_t> s = splitSizes(l);
  EXPECT_EQ(s, (std::vector<int64_t>{5, 3, 3, 1, 8, 4}));
  EXPECT_EQ(std::accumulate(s.begin(), s.end(), int64_t{0}), l.paddedNumel);
  EXPECT_EQ(splitSizes(layout({}, 4, 2)), (std::vector<int64_t>{8}));
}

TEST(FlatLayout, RejectsBadOptions) {
  EXPECT_THROW(layout({1}, 0, 1), Error);
  EXPECT_THROW(layout({1}, 1, 0), Error);
  EXPECT_THROW(layout({-1}, 1, 1), Error);
}

TEST(ShardMath, RangesTileTheBuffer) {
  FlatLayout l = layout({10, 7}, 1, 4);
  int64_t pos = 0;
  for (int64_t r = 0; r < 4; ++r) {
    ShardRange s = shardRange(l, r);
    EXPECT_EQ(s.begin, pos);
    EXPECT_EQ(s.end - s.begin, l.shardNumel);
    pos = s.end;
  }
  EXPECT_EQ(pos, l.paddedNumel);
  EXPECT_THROW(shardRange(l, 4), Error);
  EXPECT_THROW(shardRange(l, -1), Error);
}

TEST(ShardMath, PiecesCoverEveryParameterElementExactlyOnce) {
  for (int64_t world = 1; world <= 5; ++world) {
    FlatLayout l = layout({10, 1, 7, 33, 2}, 4, world);
    std::vector<std::vector<int>> hit(l.numels.size());
    for (size_t i = 0; i < l.numels.size(); ++i) hit[i].assign(l.numels[i], 0);
    for (int64_t r = 0; r < world; ++r) {
      ShardRange s = shardRange(l, r);
      for (const ShardPiece& p : piecesInShard(l, r)) {
        ASSERT_LT(p.paramBegin, p.paramEnd);
        // The piece sits in the shard where the flat layout says it does.
        EXPECT_EQ(s.begin + p.shardOffset, l.offsets[p.param] + p.paramBegin);
        EXPECT_LE(p.shardOffset + (p.paramEnd - p.paramBegin), l.shardNumel);
        for (int64_t e = p.paramBegin; e < p.paramEnd; ++e) hit[p.param][e]++;
      }
    }
    for (auto& h : hit)
      for (int c : h) EXPECT_EQ(c, 1) << "world " << world;
  }
}

TEST(ShardMath, ReshardCopiesEveryDataElementFromItsOldShard) {
  const std::vector<int64_t> numels = {10, 1, 7, 33, 2};
  for (int64_t from = 1; from <= 4; ++from) {
    for (int64_t to = 1; to <= 4; ++to) {
      FlatLayout src = layout(numels, 4, from), dst = layout(numels, 4, to);
      // Source shards hold their flat index as value; rebuilding must reproduce the index.
      for (int64_t r = 0; r < to; ++r) {
        std::vector<int64_t> shard(dst.shardNumel, -1);
        for (const ReshardPiece& p : reshardPieces(src, dst, r)) {
          ASSERT_LT(p.srcRank, from);
          ASSERT_LE(p.srcOffset + p.length, src.shardNumel);
          for (int64_t k = 0; k < p.length; ++k) shard[p.dstOffset + k] = p.srcRank * src.shardNumel + p.srcOffset + k;
        }
        for (int64_t k = 0; k < dst.shardNumel; ++k) {
          const int64_t flat = r * dst.shardNumel + k;
          EXPECT_EQ(shard[k], flat < dst.unpaddedNumel ? flat : -1) << from << "->" << to << " rank " << r;
        }
      }
    }
  }
}

TEST(ShardMath, ReshardRefusesDifferentParameters) {
  EXPECT_THROW(reshardPieces(layout({4, 4}, 4, 2), layout({4, 5}, 4, 2), 0), Error);
  EXPECT_THROW(reshardPieces(layout({4}, 4, 2), layout({4, 4}, 4, 2), 0), Error);
  EXPECT_THROW(reshardPieces(layout({4}, 4, 2), layout({4}, 2, 2), 0), Error);
}

}  // namespace
}  // namespace tdx
