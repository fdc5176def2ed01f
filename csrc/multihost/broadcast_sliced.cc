// The sliced broadcast across hosts (see sliced.h).
#include <algorithm>

#include "backend/tensor_utils.h"
#include "collectives/collectives.h"
#include "common/logging.h"
#include "multihost/gloo_wait.h"
#include "multihost/sliced.h"

namespace tdx {

void slicedBroadcast(Link& link, MismatchCheck& check, Agreement& a, const std::vector<at::Tensor>& tensors, int root,
                     uint64_t chunkFloorBytes, const WaitContext& ctx) {
  const HostLayout& layout = link.layout();
  const auto [rootHost, rootLocal] = layout.placeOf(root);
  std::vector<Staged> staged = stageAll(tensors, /*copyIn=*/link.rank() == root);
  // The rank with the root's local index on each host receives across hosts, then is the root of
  // its host's shared-memory broadcast, chunk by chunk as the chunks arrive.
  const bool relay = layout.localRank == rootLocal;
  // The chunks go down a chain of the slice's hosts starting at the root's, as Gloo p2p on the
  // calling thread, each host passing every chunk on as it arrives, so each byte crosses each host
  // link once (Gloo's broadcast sends from the root to every rank: its link carries the bytes H - 1
  // times). Between two hosts the chain is one send: Gloo's broadcast in the slice group there
  // (its hand-off to Gloo's worker thread and back) was 0.91x-1.00x gloo's speed at 1-2 MB
  // unshaped, against 1.06x-1.36x for the send (docs/bench/hosts-2x2-2core.txt).
  const int H = layout.numHosts;
  const int pos = (layout.hostIndex - rootHost + H) % H;  // this host's place in the chain
  const int prev = (layout.hostIndex + H - 1) % H, next = (layout.hostIndex + 1) % H;
  std::vector<GlooWork> works, sends;
  try {
    for (auto& s : staged) {
      at::Tensor b = bytesOf(s.tensor());
      // A chain fills in H - 1 chunk times: its chunks are H - 1 times smaller (same floor).
      const int64_t n = b.numel(), chunk = tuning::chunkElems(chunkFloorBytes, 1, n / (H - 1));
      works.clear();
      if (relay) {
        for (int64_t off = 0; off < n; off += chunk) {
          std::vector<at::Tensor> v{b.narrow(0, off, std::min(chunk, n - off))};
          if (pos == 0) {
            sends.push_back(link.slice().send(v, next, kChainTag));
          } else {
            works.push_back(link.slice().recv(v, prev, kChainTag));  // every receive posted at once
          }
        }
      }
      // The host's ranks compare descriptors only now, with the first transfer already posted: a
      // Gloo send goes out once its receiver has posted the receive (Gloo's p2p waits for the
      // receiver's notice), so a relay that posts late, or a root held back by a late host mate,
      // put a network round trip or that mate's lateness on every rank's path (2 x 2, unshaped,
      // 64-256 KB: docs/multihost.md, "Measured"). A mismatch found here abandons the posted
      // transfers (kept below) and fails the group, as any mismatch does.
      check.confirm(a, ctx);
      // The root serves its own host from its tensor while its chunks cross to the other hosts.
      for (int64_t off = 0, i = 0; off < n; off += chunk, ++i) {
        const int64_t len = std::min(chunk, n - off);
        if (relay && pos > 0) {
          link.wait(works[i], ctx);
          if (pos < H - 1) {
            std::vector<at::Tensor> v{b.narrow(0, off, len)};
            sends.push_back(link.slice().send(v, next, kChainTag));
          }
        }
        BroadcastOptions bo;
        bo.data = SpanList(static_cast<char*>(b.data_ptr()) + off, static_cast<size_t>(len));
        bo.root = rootLocal;
        link.runLocal([&] { tdx::broadcast(link.local(), bo, ctx); });
      }
      if (!sends.empty()) link.wait(sends, ctx);
      sends.clear();
    }
    check.confirm(a, ctx);  // no tensors (a second confirm does nothing)
  } catch (const std::exception& e) {
    // Gloo may still write into (or read from) the chunks of a transfer given up on: its Work
    // holds the tensor, so the abandoned ones are kept for the process's life.
    keepAbandoned(works);
    keepAbandoned(sends);
    if (dynamic_cast<const Error*>(&e)) throw;
    link.fail(e, ctx);  // a p2p send posted to a closed connection
  }
  if (link.rank() != root) finishAll(staged);
}

}  // namespace tdx
