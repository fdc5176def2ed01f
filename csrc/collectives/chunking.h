// Chunk sizes shared by the collectives: 64-byte aligned so every slice starts on a cache line
// and on an element boundary for every dtype.
#pragma once

#include <algorithm>
#include <cstddef>

#include "common/round_up.h"

namespace tdx {

constexpr size_t kSliceAlign = 64;

inline size_t alignDown(size_t v, size_t a) { return v / a * a; }

// The largest 64-byte aligned slot when a buffer half is split into `parts` slots.
inline size_t slotBytes(size_t halfBytes, int parts) {
  return std::max<size_t>(kSliceAlign, alignDown(halfBytes / static_cast<size_t>(parts), kSliceAlign));
}

// Bytes of [off, off + chunk) that fall inside a block of `total` bytes.
inline size_t clampChunk(size_t total, size_t off, size_t chunk) {
  return off >= total ? 0 : std::min(chunk, total - off);
}

}  // namespace tdx
