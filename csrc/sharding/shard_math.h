// Shard math over a FlatLayout (torch-free): which range of the flat buffer each rank owns, which
// pieces of which parameters fall in it, and how shards saved with one world size map onto
// another (for loading a sharded checkpoint into a different world size).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "sharding/flat_layout.h"

namespace tdx {

struct ShardRange {
  int64_t begin = 0;  // first flat element of the shard
  int64_t end = 0;    // one past the last
};

// The [begin, end) range of the padded flat buffer that `rank` owns. Throws on rank >= worldSize.
ShardRange shardRange(const FlatLayout& layout, int64_t rank);

// A piece of parameter `param` (elements [paramBegin, paramEnd) of its flattened view) that lies
// in a shard, at element `shardOffset` of that shard.
struct ShardPiece {
  int64_t param = 0;
  int64_t paramBegin = 0;
  int64_t paramEnd = 0;
  int64_t shardOffset = 0;
};

// Every parameter piece that falls inside `rank`'s shard, in flat order (padding excluded).
std::vector<ShardPiece> piecesInShard(const FlatLayout& layout, int64_t rank);

// A copy from a shard of the source world size into a shard of the destination world size:
// `length` elements from element `srcOffset` of source rank `srcRank`'s shard to element
// `dstOffset` of the destination shard.
struct ReshardPiece {
  int64_t srcRank = 0;
  int64_t srcOffset = 0;
  int64_t length = 0;
  int64_t dstOffset = 0;
};

// Pieces that fill destination rank `dstRank`'s shard of `dst` from the shards of `src`. Both
// layouts must hold the same parameters (same numels and alignment) and differ only in world size;
// throws tdx::Error naming the first difference otherwise. Only data up to unpaddedNumel is
// copied; the rest of the destination shard is padding (the caller zero-fills it).
std::vector<ReshardPiece> reshardPieces(const FlatLayout& src, const FlatLayout& dst, int64_t dstRank);

}  // namespace tdx
