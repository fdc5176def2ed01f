// all_to_all with uneven blocks: per round, every rank copies a chunk of each destination's block
// into that destination's slot of its buffer half; every rank copies its slot from every peer.
// The first round also exchanges each rank's largest block, so all ranks run the same number of
// rounds without knowing the whole split matrix.
#include <algorithm>
#include <cstring>

#include "collectives/chunking.h"
#include "collectives/collectives.h"
#include "collectives/op_desc.h"
#include "common/logging.h"

namespace tdx {

void alltoall(ShmGroup& g, const AlltoallOptions& o, const WaitContext& ctx) {
  const int n = g.size();
  const int me = g.rank();
  TDX_CHECK_EQ(o.in.size(), static_cast<size_t>(n));
  TDX_CHECK_EQ(o.out.size(), static_cast<size_t>(n));
  size_t localMax = 0;
  for (int p = 0; p < n; ++p) localMax = std::max({localMax, o.in[p].bytes, o.out[p].bytes});
  shm::OpDesc desc = makeDesc(ctx, OpCode::kAlltoall, DataType::kBytes, 0);
  desc.aux = localMax;
  const size_t chunk = slotBytes(g.halfBytes(), n);
  size_t globalMax = localMax;
  bool first = true;
  for (size_t off = 0; off < globalMax || first;) {
    const int h = g.acquireHalf(ctx);
    if (first) publishDesc(g, h, desc);
    for (int q = 0; q < n; ++q) {
      const size_t bytes = clampChunk(o.in[q].bytes, off, chunk);
      if (q != me && bytes) std::memcpy(g.half(me, h) + q * chunk, o.in[q].ptr + off, bytes);
    }
    const uint32_t filled = g.post();
    g.waitAll(filled, ctx);
    if (first) {
      for (int r = 0; r < n; ++r) {
        if (r == me) continue;
        checkDesc(g, r, h, desc, /*checkBytes=*/false);
        globalMax = std::max<size_t>(globalMax, g.desc(r, h).aux);
      }
    }
    for (int p = 0; p < n; ++p) {
      const size_t bytes = clampChunk(o.out[p].bytes, off, chunk);
      if (!bytes) continue;
      const char* src = p == me ? o.in[me].ptr + off : g.half(p, h) + me * chunk;
      std::memcpy(o.out[p].ptr + off, src, bytes);
    }
    g.releaseHalf(h, g.post());
    off += chunk;
    first = false;
  }
}

}  // namespace tdx
