// reduce_scatter: per round, every rank copies a chunk of each destination's block into that
// destination's slot of its buffer half (its own block stays where it is); rank r folds slot r of
// every rank, in rank order, straight into its output.
#include <cstring>
#include <vector>

#include "collectives/chunking.h"
#include "collectives/collectives.h"
#include "collectives/op_desc.h"
#include "collectives/reduce_kernels.h"
#include "collectives/stream_copy.h"
#include "common/logging.h"

namespace tdx {

void reduceScatter(ShmGroup& g, const ReduceScatterOptions& o, const WaitContext& ctx) {
  const int n = g.size();
  const int me = g.rank();
  const size_t total = o.out.bytes;
  const size_t elem = elementSize(o.dtype);
  TDX_CHECK_EQ(o.in.size(), static_cast<size_t>(n));
  TDX_CHECK_EQ(total % elem, 0u);
  const shm::OpDesc desc = makeDesc(ctx, OpCode::kReduceScatter, o.dtype, total, -1, o.op, true);
  const size_t chunk = slotBytes(g.halfBytes(), n);
  std::vector<const void*> src(n);
  const PeerCopy peer(PeerOp::kReduceScatter, total * n, ctx.seq);
  bool first = true;
  for (size_t off = 0; off < total || first;) {
    const size_t bytes = clampChunk(total, off, chunk);
    const int h = acquireRound(g, first, desc, ctx);
    for (int p = 0; p < n; ++p) {
      if (p != me && bytes) peer(g.half(me, h) + p * chunk, o.in[p].ptr + off, bytes);
    }
    const uint32_t filled = g.post();
    g.waitAll(filled, ctx);
    if (first) {
      for (int r = 0; r < n; ++r) {
        if (r != me) checkDesc(g, r, h, desc);
      }
    }
    if (bytes) {
      for (int r = 0; r < n; ++r) src[r] = r == me ? o.in[me].ptr + off : g.half(r, h) + me * chunk;
      reduceInto(o.out.ptr + off, src.data(), n, bytes / elem, o.dtype, o.op);
    }
    g.releaseHalf(h, g.post());
    off += chunk;
    first = false;
  }
}

}  // namespace tdx
