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

namespace {
uint64_t mix(uint64_t h, uint64_t v) {
  // splitmix64 finalizer over the running value: cheap, and no two small inputs collide in practice.
  uint64_t z = h ^ (v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
}  // namespace

uint64_t nextHistory(uint64_t history, const shm::OpDesc& d) {
  uint64_t h = mix(history, d.seq);
  h = mix(h, d.op);
  h = mix(h, d.dtype);
  h = mix(h, static_cast<uint64_t>(static_cast<int64_t>(d.root)));
  return mix(h, static_cast<uint64_t>(static_cast<int64_t>(d.redop)));
}

void publishDesc(shm::ShmGroup& g, int h, const shm::OpDesc& mine) {
  shm::OpDesc d = mine;
  d.history = g.descHistory();
  g.prevRooted(g.rank()) = g.lastRooted();
  g.desc(g.rank(), h) = d;
  g.descHistory() = nextHistory(g.descHistory(), d);
  if (d.root >= 0) g.lastRooted() = d;
}

std::string describeDesc(const shm::OpDesc& d) {
  std::string s = str(opCodeName(static_cast<OpCode>(d.op)), "(sequence ", d.seq, ", dtype ",
                      dataTypeName(static_cast<DataType>(d.dtype)), ", ", d.bytes, " bytes");
  if (d.root >= 0) s += str(", root ", d.root);
  if (d.redop >= 0) s += str(", op ", reduceOpName(static_cast<ReduceOp>(d.redop)));
  return s + ")";
}

std::string historyMismatch(const std::string& group, const std::string& me, const shm::OpDesc& mine,
                            const shm::OpDesc& myPrevRooted, const std::string& them, const shm::OpDesc& theirPrevRooted) {
  std::string s = str("tdx: mismatched collectives in group '", group, "': rank ", me, " and rank ", them,
                      " agree on ", describeDesc(mine), " but disagreed on an earlier collective that did not make them "
                      "wait for each other (so it could not be caught then)");
  if (myPrevRooted.op != 0 || theirPrevRooted.op != 0) {
    s += str(": the last rooted one before this was ", myPrevRooted.op ? describeDesc(myPrevRooted) : "none",
             " on rank ", me, " but ", theirPrevRooted.op ? describeDesc(theirPrevRooted) : "none", " on rank ", them);
  }
  return s + ". Every rank must call the same collectives in the same order with the same root and reduce op "
             "(set TDX_DEBUG=1 to catch it in the call itself)";
}

void checkDesc(const shm::ShmGroup& g, int r, int h, const shm::OpDesc& expected, bool checkBytes) {
  const shm::OpDesc theirs = g.desc(r, h);
  const bool same = theirs.seq == expected.seq && theirs.op == expected.op && theirs.dtype == expected.dtype &&
                    (!checkBytes || theirs.bytes == expected.bytes) && theirs.root == expected.root &&
                    theirs.redop == expected.redop;
  const shm::OpDesc& mine = g.desc(g.rank(), h);
  if (same && theirs.history != mine.history) {
    std::string msg = historyMismatch(g.info().name, g.info().describeRank(g.rank()), expected,
                                      g.prevRooted(g.rank()), g.info().describeRank(r), g.prevRooted(r));
    WaitContext ctx;
    ctx.op = opCodeName(static_cast<OpCode>(expected.op));
    ctx.seq = expected.seq;
    g.markFailed(ctx, msg);
    throw Error(msg);
  }
  if (!same) {
    std::string msg = str("tdx: mismatched collectives in group '", g.info().name, "': rank ",
                    g.info().describeRank(g.rank()), " expects ", describeDesc(expected), " but rank ",
                    g.info().describeRank(r), " called ", describeDesc(theirs),
                    ". Every rank must call the same collectives in the same order with the same dtype, "
                    "size, root and reduce op");
    WaitContext ctx;
    ctx.op = opCodeName(static_cast<OpCode>(expected.op));
    ctx.seq = expected.seq;
    g.markFailed(ctx, msg);
    throw Error(msg);
  }
}

PendingAgree beginAgree(shm::ShmGroup& g, const shm::OpDesc& mine, const WaitContext& ctx) {
  PendingAgree p;
  p.half = g.acquireHalf(ctx);
  publishDesc(g, p.half, mine);
  p.filled = g.post();
  return p;
}

void finishAgree(shm::ShmGroup& g, const PendingAgree& p, const shm::OpDesc& mine, const WaitContext& ctx,
                 bool checkBytes) {
  g.waitAll(p.filled, ctx);
  for (int r = 0; r < g.size(); ++r) {
    if (r != g.rank()) checkDesc(g, r, p.half, mine, checkBytes);
  }
  g.releaseHalf(p.half, g.post());
}

void recheckAgree(const shm::ShmGroup& g, const PendingAgree& p, const shm::OpDesc& mine, bool checkBytes) {
  for (int r = 0; r < g.size(); ++r) {
    if (r != g.rank() && g.desc(r, p.half).seq == mine.seq) checkDesc(g, r, p.half, mine, checkBytes);
  }
}

void agree(shm::ShmGroup& g, const shm::OpDesc& mine, const WaitContext& ctx, bool checkBytes) {
  finishAgree(g, beginAgree(g, mine, ctx), mine, ctx, checkBytes);
}

void checkRooted(shm::ShmGroup& g, int h, uint32_t filled, const shm::OpDesc& mine, const WaitContext& ctx) {
  g.waitAll(filled, ctx);
  for (int r = 0; r < g.size(); ++r) {
    if (r != g.rank()) checkDesc(g, r, h, mine);
  }
}

void fullCheck(shm::ShmGroup& g, int h, const shm::OpDesc& mine, const WaitContext& ctx, bool checkBytes) {
  if (!g.fullChecks()) return;
  g.waitAll(g.post(), ctx);
  for (int r = 0; r < g.size(); ++r) {
    if (r != g.rank()) checkDesc(g, r, h, mine, checkBytes);
  }
}

int acquireRound(shm::ShmGroup& g, bool first, const shm::OpDesc& mine, const WaitContext& ctx, bool checkBytes) {
  const int h = g.acquireHalf(ctx);
  if (first) {
    publishDesc(g, h, mine);
    fullCheck(g, h, mine, ctx, checkBytes);
  }
  return h;
}

}  // namespace tdx
