// barrier: every rank posts its arrival and waits for all others' (one synchronization).
#include "collectives/collectives.h"
#include "collectives/op_desc.h"

namespace tdx {

void barrier(ShmGroup& g, const WaitContext& ctx) {
  const shm::OpDesc desc = makeDesc(ctx, OpCode::kBarrier, DataType::kBytes, 0);
  agree(g, desc, ctx);
}

}  // namespace tdx
