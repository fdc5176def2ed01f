// all_to_all with uneven blocks: per round, every rank copies a chunk of each destination's block
// into that destination's slot of its buffer half; every rank copies its slot from every peer.
// The first round also exchanges each rank's largest block, so all ranks run the same number of
// rounds without knowing the whole split matrix.
#include <algorithm>
#include <cstring>

#include "collectives/chunking.h"
#include "collectives/collectives.h"
#include "collectives/op_desc.h"
#include "collectives/stream_copy.h"
#include "common/logging.h"

namespace tdx {

namespace {

// Every rank compares its blocks with the peers' rows of the split matrix (published in the first
// round, read after its synchronization): what it receives from p must be what p sends to it, and
// every rank's block to itself must be the size it expects from itself (checked on every rank, so
// all raise in the call; at one rank that is the only check).
void checkSplits(const ShmGroup& g, int h, const AlltoallOptions& o, const WaitContext& ctx) {
  const int n = g.size();
  const int me = g.rank();
  auto fail = [&](const std::string& what, const char* rule) {
    std::string msg = str("tdx: mismatched all_to_all split sizes in group '", g.info().name, "' (sequence ", ctx.seq,
                          "): ", what, ". ", rule);
    g.markFailed(ctx, msg);
    throw Error(msg);
  };
  for (int r = 0; r < n; ++r) {
    const uint64_t* row = g.detail(r, h);
    if (row[r] == row[n + r]) continue;
    fail(str("rank ", g.info().describeRank(r), " sends itself ", row[r], " bytes but expects ", row[n + r],
             " bytes from itself"),
         "Each rank's input and output split sizes for itself must be equal");
  }
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    const uint64_t* row = g.detail(p, h);
    const uint64_t sends = row[me], expects = row[n + me];
    if (sends == o.out[p].bytes && expects == o.in[p].bytes) continue;
    fail(str("rank ", g.info().describeRank(me), " expects ", o.out[p].bytes, " bytes from rank ",
             g.info().describeRank(p), " and sends it ", o.in[p].bytes, " bytes, but rank ", g.info().describeRank(p),
             " sends ", sends, " bytes and expects ", expects),
         "Each rank's output split for p must equal p's input split for it");
  }
}

}  // namespace

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
  size_t sent = 0;
  for (int q = 0; q < n; ++q) sent += q == me ? 0 : o.in[q].bytes;
  const PeerCopy peer(PeerOp::kAlltoall, sent, ctx.seq);
  size_t globalMax = localMax;
  bool first = true;
  for (size_t off = 0; off < globalMax || first;) {
    const int h = acquireRound(g, first, desc, ctx, /*checkBytes=*/false);
    if (first) {
      // This rank's row of the split matrix: bytes to and from each peer.
      uint64_t* row = g.detail(me, h);
      for (int q = 0; q < n; ++q) {
        row[q] = o.in[q].bytes;
        row[n + q] = o.out[q].bytes;
      }
    }
    for (int q = 0; q < n; ++q) {
      const size_t bytes = clampChunk(o.in[q].bytes, off, chunk);
      if (q != me && bytes) peer(g.half(me, h) + q * chunk, o.in[q].ptr + off, bytes);
    }
    const uint32_t filled = g.post();
    g.waitAll(filled, ctx);
    if (first) {
      for (int r = 0; r < n; ++r) {
        if (r == me) continue;
        checkDesc(g, r, h, desc, /*checkBytes=*/false);
        globalMax = std::max<size_t>(globalMax, g.desc(r, h).aux);
      }
      checkSplits(g, h, o, ctx);
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
