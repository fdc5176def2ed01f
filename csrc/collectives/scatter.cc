// scatter: per round, the root copies a chunk of each rank's block into that rank's slot of its
// buffer half; each rank copies its slot out.
#include <cstring>

#include "collectives/chunking.h"
#include "collectives/collectives.h"
#include "collectives/op_desc.h"
#include "collectives/stream_copy.h"
#include "common/logging.h"

namespace tdx {

void scatter(ShmGroup& g, const ScatterOptions& o, const WaitContext& ctx) {
  const int n = g.size();
  const int me = g.rank();
  const size_t total = o.out.bytes;
  if (me == o.root) TDX_CHECK_EQ(o.in.size(), static_cast<size_t>(n));
  const shm::OpDesc desc = makeDesc(ctx, OpCode::kScatter, DataType::kBytes, total, o.root);
  const size_t chunk = slotBytes(g.halfBytes(), n);
  const PeerCopy peer(PeerOp::kScatter, total * (n - 1), ctx.seq);
  bool first = true;
  for (size_t off = 0; off < total || first;) {
    const size_t bytes = clampChunk(total, off, chunk);
    const int h = acquireRound(g, first, desc, ctx);
    if (me == o.root) {
      for (int p = 0; p < n; ++p) {
        if (p != me && bytes) peer(g.half(me, h) + p * chunk, o.in[p].ptr + off, bytes);
      }
      if (bytes) std::memcpy(o.out.ptr + off, o.in[me].ptr + off, bytes);
    }
    const uint32_t filled = g.post();
    if (first) checkRooted(g, h, filled, desc, ctx);
    if (me != o.root) {
      g.waitRank(o.root, filled, ctx);
      if (bytes) std::memcpy(o.out.ptr + off, g.half(o.root, h) + me * chunk, bytes);
    }
    g.releaseHalf(h, g.post());
    off += chunk;
    first = false;
  }
}

}  // namespace tdx
