// all_gather and gather: per round of up to one buffer half, every rank copies its chunk into
// its half; every rank (or only the root) copies every peer's chunk out. Contributions may have
// different sizes; the number of rounds follows the largest.
#include <algorithm>

#include "collectives/chunking.h"
#include "collectives/collectives.h"
#include "collectives/op_desc.h"
#include "collectives/stream_copy.h"
#include "common/logging.h"

#include <cstring>

namespace tdx {

void allgather(ShmGroup& g, const AllgatherOptions& o, const WaitContext& ctx) {
  const int n = g.size();
  const int me = g.rank();
  const bool isGather = o.root >= 0;
  const bool receives = !isGather || o.root == me;
  if (receives) TDX_CHECK_EQ(o.out.size(), static_cast<size_t>(n));
  size_t maxBytes = o.in.bytes;
  if (receives) {
    for (const Span& s : o.out) maxBytes = std::max(maxBytes, s.bytes);
  }
  shm::OpDesc desc =
      makeDesc(ctx, isGather ? OpCode::kGather : OpCode::kAllgather, DataType::kBytes, o.in.bytes, o.root);
  desc.aux = maxBytes;  // a gather's root publishes its largest block: non-roots run as many rounds
  const size_t chunk = g.halfBytes();
  bool first = true;
  for (size_t off = 0; off < maxBytes || first;) {
    // A gather's blocks all have the root's size; an all_gather's may differ (checked per slot).
    const int h = acquireRound(g, first, desc, ctx, /*checkBytes=*/isGather);
    const size_t mine = clampChunk(o.in.bytes, off, chunk);
    if (mine) copyToPeers(g.half(me, h), o.in.ptr + off, mine);
    const uint32_t filled = g.post();
    if (receives) {
      g.waitAll(filled, ctx);
      for (int p = 0; p < n; ++p) {
        if (first && p != me) {
          shm::OpDesc expect = desc;
          expect.bytes = o.out[p].bytes;  // rank p's contribution must fit its output slot
          checkDesc(g, p, h, expect);
        }
        const size_t bytes = clampChunk(o.out[p].bytes, off, chunk);
        if (!bytes) continue;
        const char* src = p == me ? o.in.ptr + off : g.half(p, h);
        std::memcpy(o.out[p].ptr + off, src, bytes);
      }
    } else if (first) {
      // A non-root of a gather knows only its own contribution; the root's largest block sets
      // the number of rounds, so every rank posts the same number of steps.
      // Every rank's descriptor, so ranks that disagree on the root raise here on every rank.
      g.waitAll(filled, ctx);
      for (int p = 0; p < n; ++p) {
        if (p != me) checkDesc(g, p, h, desc, /*checkBytes=*/false);  // a gather may be uneven
      }
      maxBytes = std::max<size_t>(maxBytes, g.desc(o.root, h).aux);
    }
    g.releaseHalf(h, g.post());
    off += chunk;
    first = false;
  }
}

}  // namespace tdx
