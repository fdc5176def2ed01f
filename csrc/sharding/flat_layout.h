// Flat parameter layout for ZeRO / FSDP (torch-free, unit-tested alone).
//
// The parameters of one wrapped unit are laid out back to back in one flat buffer: each starts at
// an offset that is a multiple of `alignment` elements, and the buffer is padded at the end so its
// size divides into `worldSize` equal shards that each start aligned. Interior offsets depend only
// on the numels and the alignment, never on the world size, so a flat buffer saved with one world
// size maps onto any other (only the tail padding differs).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tdx {

struct FlatLayoutOptions {
  int64_t alignment = 4;  // elements; every parameter and every shard starts at a multiple of it
  int64_t worldSize = 1;  // number of shards the padded buffer divides into
};

struct FlatLayout {
  std::vector<int64_t> numels;   // per parameter, in flat order
  std::vector<int64_t> offsets;  // per parameter: first element in the flat buffer
  int64_t unpaddedNumel = 0;     // end of the last parameter (alignment gaps included)
  int64_t paddedNumel = 0;       // multiple of worldSize * alignment, >= unpaddedNumel
  int64_t shardNumel = 0;        // paddedNumel / worldSize
  int64_t alignment = 1;
  int64_t worldSize = 1;
};

// Lays out parameters of the given numels (each >= 0). Throws tdx::Error on alignment < 1,
// worldSize < 1 or a negative numel, naming the operand.
FlatLayout makeFlatLayout(const std::vector<int64_t>& numels, const FlatLayoutOptions& options);

// Sizes that split the padded flat buffer into [param 0, gap 0, param 1, gap 1, ..., param k-1, tail]:
// 2 * numParams entries (zeros included; {paddedNumel} when there are none) summing to paddedNumel.
// torch.split with these sizes yields parameter i at index 2 * i, with one SplitBackward per unit.
std::vector<int64_t> splitSizes(const FlatLayout& layout);

}  // namespace tdx
