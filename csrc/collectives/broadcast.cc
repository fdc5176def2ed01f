// broadcast: per round of up to one buffer half, the root copies its data into its half and
// every other rank copies it out. Rounds alternate halves so copy-in and copy-out overlap.
#include "collectives/chunking.h"
#include "collectives/collectives.h"
#include "collectives/op_desc.h"
#include "collectives/stream_copy.h"
#include "common/logging.h"

namespace tdx {

void broadcast(ShmGroup& g, const BroadcastOptions& o, const WaitContext& ctx) {
  const int me = g.rank();
  const size_t total = o.data.total();
  const shm::OpDesc desc = makeDesc(ctx, OpCode::kBroadcast, DataType::kBytes, total, o.root);
  const PeerCopy peer(PeerOp::kBroadcast, total, ctx.seq);
  bool first = true;
  for (size_t off = 0; off < total || first;) {
    const size_t round = std::min(total - off, g.halfBytes());
    const int h = acquireRound(g, first, desc, ctx);
    if (me == o.root) o.data.copyOut(off, round, g.half(me, h), peer);
    const uint32_t filled = g.post();
    if (first) checkRooted(g, h, filled, desc, ctx);
    if (me != o.root) {
      g.waitRank(o.root, filled, ctx);
      o.data.copyIn(off, round, g.half(o.root, h));
    }
    g.releaseHalf(h, g.post());
    off += round;
    first = false;
  }
}

}  // namespace tdx
