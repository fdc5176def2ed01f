// barrier: every rank posts its arrival and waits for all others' (one synchronization).
#include "collectives/collectives.h"
#include "collectives/op_desc.h"

namespace tdx {

void barrier(ShmGroup& g, const WaitContext& ctx) {
  const shm::OpDesc desc = makeDesc(ctx, OpCode::kBarrier, DataType::kBytes, 0);
  const int h = g.acquireHalf(ctx);
  publishDesc(g, h, desc);
  const uint32_t arrived = g.post();
  g.waitAll(arrived, ctx);
  for (int r = 0; r < g.size(); ++r) {
    if (r != g.rank()) checkDesc(g, r, h, desc);
  }
  g.releaseHalf(h, g.post());
}

}  // namespace tdx
