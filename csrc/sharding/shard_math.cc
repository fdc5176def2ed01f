#include "sharding/shard_math.h"

#include <algorithm>

#include "common/logging.h"

namespace tdx {

ShardRange shardRange(const FlatLayout& layout, int64_t rank) {
  TDX_ENFORCE(rank >= 0 && rank < layout.worldSize, "shard range: rank ", rank, " is outside world size ",
              layout.worldSize);
  return ShardRange{rank * layout.shardNumel, (rank + 1) * layout.shardNumel};
}

std::vector<ShardPiece> piecesInShard(const FlatLayout& layout, int64_t rank) {
  const ShardRange r = shardRange(layout, rank);
  std::vector<ShardPiece> pieces;
  for (size_t i = 0; i < layout.numels.size(); ++i) {
    const int64_t pBegin = layout.offsets[i];
    const int64_t pEnd = pBegin + layout.numels[i];
    const int64_t lo = std::max(pBegin, r.begin);
    const int64_t hi = std::min(pEnd, r.end);
    if (lo >= hi) continue;
    pieces.push_back(ShardPiece{static_cast<int64_t>(i), lo - pBegin, hi - pBegin, lo - r.begin});
  }
  return pieces;
}

std::vector<ReshardPiece> reshardPieces(const FlatLayout& src, const FlatLayout& dst, int64_t dstRank) {
  TDX_ENFORCE(src.numels.size() == dst.numels.size(), "reshard: the source holds ", src.numels.size(),
              " parameters but the destination ", dst.numels.size());
  for (size_t i = 0; i < src.numels.size(); ++i) {
    TDX_ENFORCE(src.numels[i] == dst.numels[i], "reshard: parameter ", i, " has ", src.numels[i],
                " elements in the source but ", dst.numels[i], " in the destination");
  }
  TDX_ENFORCE(src.alignment == dst.alignment, "reshard: source alignment ", src.alignment,
              " differs from destination alignment ", dst.alignment);
  TDX_CHECK_EQ(src.unpaddedNumel, dst.unpaddedNumel);
  const ShardRange d = shardRange(dst, dstRank);
  const int64_t end = std::min(d.end, dst.unpaddedNumel);
  std::vector<ReshardPiece> pieces;
  for (int64_t pos = d.begin; pos < end;) {
    const int64_t srcRank = pos / src.shardNumel;
    const int64_t srcEnd = std::min((srcRank + 1) * src.shardNumel, end);
    pieces.push_back(ReshardPiece{srcRank, pos - srcRank * src.shardNumel, srcEnd - pos, pos - d.begin});
    pos = srcEnd;
  }
  return pieces;
}

}  // namespace tdx
