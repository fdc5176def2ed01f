// CPU implementation of the fused multi-tensor pack/unpack (DDP buckets, FSDP flat parameters):
// loops over the same per-chunk functions (pack_math.h) the CUDA kernels run. No torch types.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/pack_math.h"

namespace tdx {
namespace kernels {

// What to pack: entry i has numels[i] elements at flat offset offsets[i] of a flat buffer of
// `total` elements, `elemSize` bytes each. `floating` (elemSize 4 = float32, 8 = float64) lets
// pack multiply by `scale` (e.g. 1 / world size for DDP's gradient averaging); other types must
// keep scale 1.
struct PackSpec {
  std::vector<int64_t> offsets;
  std::vector<int64_t> numels;
  int64_t total = 0;
  int elemSize = 4;
  bool floating = true;
  float scale = 1.0f;
  int64_t chunkElems = 1 << 16;
};

// "" when the spec is usable, else a sentence saying what is wrong.
std::string checkSpec(const PackSpec& spec);

// flat[offsets[i] + j] = srcs[i][j] * scale; padding elements become zero.
void packCpu(const PackSpec& spec, const std::vector<const void*>& srcs, void* flat);
// dsts[i][j] = flat[offsets[i] + j]; padding is not read.
void unpackCpu(const PackSpec& spec, const void* flat, const std::vector<void*>& dsts);

}  // namespace kernels
}  // namespace tdx
