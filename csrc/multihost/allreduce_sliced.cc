// The sliced all_reduce and reduce across hosts (see sliced.h).
#include <algorithm>

#include "backend/tensor_utils.h"
#include "collectives/collectives.h"
#include "common/logging.h"
#include "collectives/reduce_kernels.h"
#include "multihost/gloo_reduce.h"
#include "multihost/gloo_wait.h"
#include "multihost/sliced.h"

namespace tdx {

void slicedAllreduce(Link& link, MismatchCheck& check, Agreement& a, const SlicedAllreduceOptions& o,
                     const WaitContext& ctx) {
  const HostLayout& layout = link.layout();
  shm::ShmGroup& local = link.local();
  const at::Tensor& flat = o.flat;
  const int64_t blk = o.blk;
  const ReduceOp op = o.op;
  const int root = o.root;
  const int L = layout.localSize, H = layout.numHosts;
  const DataType dt = reduceDtype("all_reduce", flat.scalar_type());
  // A reduce sends the slices to the root's host only; the other hosts are done once theirs left.
  const auto [rootHost, rootLocal] = root >= 0 ? layout.placeOf(root) : std::pair<int, int>{-1, -1};
  const bool gatherHere = root < 0 || layout.hostIndex == rootHost;
  at::Tensor slice = link.scratch(0, blk, flat.scalar_type());
  const bool exchange = o.link == tuning::LinkAlgo::kSliceExchange;
  const bool chain = o.link == tuning::LinkAlgo::kChain;
  // Every host's partial of each chunk, at the chunk's offset (chunks in flight do not overlap).
  at::Tensor partials = exchange ? link.scratch(1, H * blk, flat.scalar_type()) : at::Tensor();
  // A chain fills in H - 1 chunk times: its chunks are H - 1 times smaller (same floor).
  const int64_t chunk = tuning::chunkElems(o.chunkFloorBytes, flat.element_size(), chain ? blk / (H - 1) : blk);
  const int pos = chain ? (layout.hostIndex - rootHost + H) % H : 0;  // 0: the root's host
  const int toward = (layout.hostIndex + H - 1) % H, from = (layout.hostIndex + 1) % H;
  at::Tensor incoming = chain && pos < H - 1 ? link.scratch(1, blk, flat.scalar_type()) : at::Tensor();
  std::vector<GlooWork> sends;
  // The chain: each host adds its own partial to what the next host passed and passes it on (Gloo
  // p2p in the slice group), so each byte crosses each host link once.
  auto chainStart = [&](int64_t off, int64_t len) {
    GlooReduction r;
    r.flat = slice.narrow(0, off, len);
    r.op = op;
    if (pos == H - 1) {
      std::vector<at::Tensor> v{bytesOf(r.flat)};
      sends.push_back(link.slice().send(v, toward, kChainTag));
    } else {
      std::vector<at::Tensor> v{bytesOf(incoming.narrow(0, off, len))};
      r.work = link.slice().recv(v, from, kChainTag);
    }
    return r;
  };
  auto chainFinish = [&](GlooReduction& r, int64_t off) {
    if (pos == H - 1) return;
    link.wait(r.work, ctx);
    const void* in[2] = {r.flat.data_ptr(), incoming.narrow(0, off, r.flat.numel()).data_ptr()};
    reduceInto(r.flat.data_ptr(), in, 2, static_cast<size_t>(r.flat.numel()), dt,
               op == ReduceOp::kAvg ? ReduceOp::kSum : op);
    if (pos > 0) {
      std::vector<at::Tensor> v{bytesOf(r.flat)};
      sends.push_back(link.slice().send(v, toward, kChainTag));
    } else if (op == ReduceOp::kAvg) {
      r.flat.div_(link.size());
    }
  };
  // Chunk c: reduce-scatter it over shared memory and start its Gloo all_reduce (reduce); with two
  // chunks on the wire, all-gather (gather to the root) the oldest one, whose result has come back.
  std::vector<std::pair<GlooReduction, int64_t>> inFlight;
  auto gatherOldest = [&] {
    auto& [red, off] = inFlight.front();
    if (chain) {
      chainFinish(red, off);
    } else {
      finishGlooAllreduce(link, red, ctx);
    }
    if (gatherHere) {
      AllgatherOptions ag;
      ag.in = spanOf(slice, off, red.flat.numel());
      ag.root = root < 0 ? -1 : rootLocal;
      if (root < 0 || layout.localRank == rootLocal) {
        for (int p = 0; p < L; ++p) ag.out.push_back(spanOf(flat, p * blk + off, red.flat.numel()));
      }
      link.runLocal([&] { tdx::allgather(local, ag, ctx); });
    }
    inFlight.erase(inFlight.begin());
  };
  try {
    for (int64_t off = 0; off < blk; off += chunk) {
      const int64_t len = std::min(chunk, blk - off);
      ReduceScatterOptions rs;
      for (int p = 0; p < L; ++p) rs.in.push_back(spanOf(flat, p * blk + off, len));
      rs.out = spanOf(slice, off, len);
      rs.dtype = dt;
      rs.op = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
      // The first chunk's reduce-scatter waits for the host mates: the descriptor check rides on it.
      check.runFirstLocal(a, [&] { tdx::reduceScatter(local, rs, ctx); }, ctx);
      inFlight.emplace_back(chain      ? chainStart(off, len)
                            : exchange ? startSliceExchange(link, slice.narrow(0, off, len),
                                                            partials.narrow(0, H * off, H * len), op, dt)
                                       : startGlooAllreduce(link, link.slice(), slice.narrow(0, off, len), op,
                                                            o.compress, rootHost),
                            off);
      if (inFlight.size() > 2) gatherOldest();
    }
    while (!inFlight.empty()) gatherOldest();
    if (!sends.empty()) link.wait(sends, ctx);  // one watch for all of them
  } catch (const std::exception& e) {
    std::vector<GlooWork> pending;
    for (auto& [red, off] : inFlight) pending.push_back(red.work);
    keepAbandoned(pending);
    keepAbandoned(sends);
    if (dynamic_cast<const Error*>(&e)) throw;
    link.fail(e, ctx);  // a p2p send posted to a closed connection
  }
}

}  // namespace tdx
