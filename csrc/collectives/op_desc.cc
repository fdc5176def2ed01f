#include "collectives/op_desc.h"

#include "common/logging.h"

namespace tdx {

const char* opCodeName(OpCode op) {
  switch (op) {
    case OpCode::kAllreduce: return "allreduce";
    case OpCode::kReduce: return "reduce";
    case OpCode::kBroadcast: return "broadcast";
    case OpCode::kAllgather: return "allgather";
    case OpCode::kGather: return "gather";
    case OpCode::kScatter: return "scatter";
    case OpCode::kReduceScatter: return "reduce_scatter";
    case OpCode::kAlltoall: return "alltoall";
    case OpCode::kBarrier: return "barrier";
  }
  return "unknown";
}

shm::OpDesc makeDesc(const WaitContext& ctx, OpCode op, DataType dt, uint64_t bytes, int root, ReduceOp redop,
                     bool hasRedop) {
  shm::OpDesc d{};
  d.seq = ctx.seq;
  d.op = static_cast<uint32_t>(op);
  d.dtype = static_cast<uint32_t>(dt);
  d.bytes = bytes;
  d.root = root;
  d.redop = hasRedop ? static_cast<int32_t>(redop) : -1;
  d.aux = 0;
  return d;
}

void publishDesc(shm::ShmGroup& g, int h, const shm::OpDesc& mine) { g.desc(g.rank(), h) = mine; }

namespace {
std::string describe(const shm::OpDesc& d) {
  std::string s = str(opCodeName(static_cast<OpCode>(d.op)), "(sequence ", d.seq, ", dtype ",
                      dataTypeName(static_cast<DataType>(d.dtype)), ", ", d.bytes, " bytes");
  if (d.root >= 0) s += str(", root ", d.root);
  if (d.redop >= 0) s += str(", op ", reduceOpName(static_cast<ReduceOp>(d.redop)));
  return s + ")";
}
}  // namespace

void checkDesc(const shm::ShmGroup& g, int r, int h, const shm::OpDesc& expected, bool checkBytes) {
  const shm::OpDesc theirs = g.desc(r, h);
  const bool same = theirs.seq == expected.seq && theirs.op == expected.op && theirs.dtype == expected.dtype &&
                    (!checkBytes || theirs.bytes == expected.bytes) && theirs.root == expected.root &&
                    theirs.redop == expected.redop;
  if (!same) {
    std::string msg = str("tdx: mismatched collectives in group '", g.info().name, "': rank ",
                    g.info().describeRank(g.rank()), " expects ", describe(expected), " but rank ",
                    g.info().describeRank(r), " called ", describe(theirs),
                    ". Every rank must call the same collectives in the same order with the same dtype, "
                    "size, root and reduce op");
    WaitContext ctx;
    ctx.op = opCodeName(static_cast<OpCode>(expected.op));
    ctx.seq = expected.seq;
    g.markFailed(ctx, msg);
    throw Error(msg);
  }
}

void fullCheck(shm::ShmGroup& g, int h, const shm::OpDesc& mine, const WaitContext& ctx, bool checkBytes) {
  if (!g.fullChecks()) return;
  g.waitAll(g.post(), ctx);
  for (int r = 0; r < g.size(); ++r) {
    if (r != g.rank()) checkDesc(g, r, h, mine, checkBytes);
  }
}

}  // namespace tdx
