// The multi-host algorithms for layouts where every host has the same number of ranks L: each
// local rank j carries 1/L of the bytes across hosts through its slice group (the ranks with local
// index j on every host), so every byte crosses a host link once and all L links' flows run at
// once; the shared-memory phases run chunk by chunk beside the network transfers.
#include <algorithm>

#include "backend/gloo_wait.h"
#include "backend/hierarchical.h"
#include "backend/tensor_utils.h"
#include "collectives/collectives.h"
#include "collectives/reduce_kernels.h"
#include "common/env.h"
#include "common/logging.h"

namespace tdx {

namespace {


constexpr int64_t kKeepScratchBytes = 256 << 20;
// The Gloo p2p tag of the chained broadcast's chunks (the slice groups carry no other p2p).
constexpr int kChainTag = 1;

// Between two hosts, an all_reduce (reduce) below this many bytes swaps its slice partials (a
// Gloo all_gather) instead of running Gloo's all_reduce (reduce) on them; at 1 MB the swap
// measured a little slower (docs/multihost.md, "Measured").
constexpr int64_t kExchangeMaxBytes = 1 << 20;

}  // namespace

// The sliced all_gather's output size from which each host's part goes straight into the outputs
// (unshaped, 2 x 2: 16 MB 0.93x gloo's speed through the buffer, 1.25x-1.28x straight; 4 MB 1.08x
// and 1.20x; 1 MB 1.30x and 1.13x, 64 KB 1.45x and 1.17x; docs/bench/hosts-2x2-2core.txt).
constexpr int64_t kDirectGatherMin = 4 << 20;

int64_t Hierarchy::chunkElems(const at::Tensor& t, int64_t total) const {
  // An eighth of the total, so the phases overlap, but at least TDX_XHOST_CHUNK_BYTES, since every
  // chunk costs a Gloo operation and a shared-memory synchronization. Unset: 2 MiB on a fast link,
  // where those costs dominate (unshaped 4 MB all_reduce 1.26-1.36x gloo with 2 MiB, 0.55-0.57x
  // with 256 KiB, docs/bench/hosts-2x2-2core.txt), else 512 KiB, so a slow link starts early. Each
  // Gloo operation is also a chance of a stall of milliseconds: at 1 Gbit/s the 1 MB all_reduce's
  // p90 was 1.37-1.58x Gloo's with 512 KiB chunks (one per slice) against 1.05-1.41x with 256 KiB,
  // medians and 4 MB alike (alternating runs, docs/bench/hosts-2x2-2core.txt).
  const size_t knob = env().xhostChunkBytes;
  const size_t bytes = knob ? knob : fastLink() ? (2u << 20) : (512u << 10);
  const int64_t floor = std::max<int64_t>(1, static_cast<int64_t>(bytes) / t.element_size());
  return std::max(floor, (total + 7) / 8);
}

at::Tensor Hierarchy::scratch(int slot, int64_t numel, at::ScalarType dtype) {
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  if (bytes > kKeepScratchBytes) return at::empty({numel}, at::TensorOptions().dtype(dtype));
  at::Tensor& kept = scratch_[slot];
  if (!kept.defined() || kept.numel() < bytes) {
    kept = at::Tensor();  // the old buffer goes first
    kept = at::empty({bytes}, at::kByte);
  }
  return kept.narrow(0, 0, bytes).view(dtype);
}

std::pair<int, int> Hierarchy::placeOf(int rank) const {
  for (int h = 0; h < layout_.numHosts; ++h) {
    const auto& rs = layout_.hostRanks[h];
    const auto it = std::find(rs.begin(), rs.end(), rank);
    if (it != rs.end()) return {h, static_cast<int>(it - rs.begin())};
  }
  throw Error(str("tdx internal error: rank ", rank, " is on no host of the group"));
}

void Hierarchy::slicedAllreduce(shm::ShmGroup& local, const at::Tensor& flat, int64_t blk, ReduceOp op, Agreement& a,
                                const WaitContext& ctx, int root) {
  const int L = layout_.localSize;
  const DataType dt = reduceDtype("all_reduce", flat.scalar_type());
  // A reduce sends the slices to the root's host only; the other hosts are done once theirs left.
  const auto [rootHost, rootLocal] = root >= 0 ? placeOf(root) : std::pair<int, int>{-1, -1};
  const bool gatherHere = root < 0 || layout_.hostIndex == rootHost;
  at::Tensor slice = scratch(0, blk, flat.scalar_type());
  // Small operations between two hosts swap the slice partials (one message each way).
  const bool exchange = exchangesSlices(flat.scalar_type(), op) && flat.nbytes() < kExchangeMaxBytes;
  // Every host's partial of each chunk, at the chunk's offset (chunks in flight do not overlap).
  const int H = layout_.numHosts;
  at::Tensor partials = exchange ? scratch(1, H * blk, flat.scalar_type()) : at::Tensor();
  // From three hosts a reduce passes each chunk's partial up a chain of hosts ending at the root's
  // (Gloo p2p in the slice group), each host adding its own, so each byte crosses each host link
  // once (Gloo's reduce of the slices: 59% of the root link's bound at 4 hosts, 16 MB).
  const bool chain = root >= 0 && chainsReduce(flat.scalar_type(), op);
  // A chain fills in H - 1 chunk times: its chunks are H - 1 times smaller (same floor).
  const int64_t chunk = chunkElems(flat, chain ? blk / (H - 1) : blk);
  const int pos = chain ? (layout_.hostIndex - rootHost + H) % H : 0;  // 0: the root's host
  const int toward = (layout_.hostIndex + H - 1) % H, from = (layout_.hostIndex + 1) % H;
  at::Tensor incoming = chain && pos < H - 1 ? scratch(1, blk, flat.scalar_type()) : at::Tensor();
  std::vector<c10::intrusive_ptr<c10d::Work>> sends;
  auto chainStart = [&](int64_t off, int64_t len) {
    GlooReduction r;
    r.flat = slice.narrow(0, off, len);
    r.op = op;
    if (pos == H - 1) {
      std::vector<at::Tensor> v{bytesOf(r.flat)};
      sends.push_back(slice_->send(v, toward, kChainTag));
    } else {
      std::vector<at::Tensor> v{bytesOf(incoming.narrow(0, off, len))};
      r.work = slice_->recv(v, from, kChainTag);
    }
    return r;
  };
  auto chainFinish = [&](GlooReduction& r, int64_t off) {
    if (pos == H - 1) return;
    waitGloo(r.work, ctx);
    const void* in[2] = {r.flat.data_ptr(), incoming.narrow(0, off, r.flat.numel()).data_ptr()};
    reduceInto(r.flat.data_ptr(), in, 2, static_cast<size_t>(r.flat.numel()), dt,
               op == ReduceOp::kAvg ? ReduceOp::kSum : op);
    if (pos > 0) {
      std::vector<at::Tensor> v{bytesOf(r.flat)};
      sends.push_back(slice_->send(v, toward, kChainTag));
    } else if (op == ReduceOp::kAvg) {
      r.flat.div_(size_);
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
      finishGlooAllreduce(red, ctx);
    }
    if (gatherHere) {
      AllgatherOptions ag;
      ag.in = spanOf(slice, off, red.flat.numel());
      ag.root = root < 0 ? -1 : rootLocal;
      if (root < 0 || layout_.localRank == rootLocal) {
        for (int p = 0; p < L; ++p) ag.out.push_back(spanOf(flat, p * blk + off, red.flat.numel()));
      }
      runLocal([&] { tdx::allgather(local, ag, ctx); });
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
      runFirstLocal(a, [&] { tdx::reduceScatter(local, rs, ctx); }, ctx);
      inFlight.emplace_back(chain      ? chainStart(off, len)
                            : exchange ? startSliceExchange(slice.narrow(0, off, len),
                                                            partials.narrow(0, H * off, H * len), op, dt)
                                       : startGlooAllreduce(*slice_, slice.narrow(0, off, len), op, rootHost),
                            off);
      if (inFlight.size() > 2) gatherOldest();
    }
    while (!inFlight.empty()) gatherOldest();
    if (!sends.empty()) waitGloo(sends, ctx);  // one watch for all of them
  } catch (const std::exception& e) {
    std::vector<c10::intrusive_ptr<c10d::Work>> pending;
    for (auto& [red, off] : inFlight) pending.push_back(red.work);
    keepAbandoned(pending);
    keepAbandoned(sends);
    if (dynamic_cast<const Error*>(&e)) throw;
    failGloo(e, ctx);  // a p2p send posted to a closed connection
  }
}

void Hierarchy::slicedBroadcast(const std::vector<at::Tensor>& tensors, int root, const WaitContext& ctx) {
  const auto [rootHost, rootLocal] = placeOf(root);
  std::vector<Staged> staged = stageAll(tensors, /*copyIn=*/rank_ == root);
  // The rank with the root's local index on each host receives across hosts, then is the root of
  // its host's shared-memory broadcast, chunk by chunk as the chunks arrive.
  const bool relay = layout_.localRank == rootLocal;
  // The chunks go down a chain of the slice's hosts starting at the root's, as Gloo p2p on the
  // calling thread, each host passing every chunk on as it arrives, so each byte crosses each host
  // link once (Gloo's broadcast sends from the root to every rank: its link carries the bytes H - 1
  // times). Between two hosts the chain is one send: Gloo's broadcast in the slice group there
  // (its hand-off to Gloo's worker thread and back) was 0.91x-1.00x gloo's speed at 1-2 MB
  // unshaped, against 1.06x-1.36x for the send (docs/bench/hosts-2x2-2core.txt).
  const int H = layout_.numHosts;
  const int pos = (layout_.hostIndex - rootHost + H) % H;  // this host's place in the chain
  const int prev = (layout_.hostIndex + H - 1) % H, next = (layout_.hostIndex + 1) % H;
  std::vector<c10::intrusive_ptr<c10d::Work>> works, sends;
  try {
    for (auto& s : staged) {
      at::Tensor b = bytesOf(s.tensor());
      // A chain fills in H - 1 chunk times: its chunks are H - 1 times smaller (same floor).
      const int64_t n = b.numel(), chunk = chunkElems(b, n / (H - 1));
      works.clear();
      if (relay) {
        for (int64_t off = 0; off < n; off += chunk) {
          std::vector<at::Tensor> v{b.narrow(0, off, std::min(chunk, n - off))};
          if (pos == 0) {
            sends.push_back(slice_->send(v, next, kChainTag));
          } else {
            works.push_back(slice_->recv(v, prev, kChainTag));  // every receive posted at once
          }
        }
      }
      // The root serves its own host from its tensor while its chunks cross to the other hosts.
      for (int64_t off = 0, i = 0; off < n; off += chunk, ++i) {
        const int64_t len = std::min(chunk, n - off);
        if (relay && pos > 0) {
          waitGloo(works[i], ctx);
          if (pos < H - 1) {
            std::vector<at::Tensor> v{b.narrow(0, off, len)};
            sends.push_back(slice_->send(v, next, kChainTag));
          }
        }
        BroadcastOptions bo;
        bo.data = SpanList(static_cast<char*>(b.data_ptr()) + off, static_cast<size_t>(len));
        bo.root = rootLocal;
        runLocal([&] { tdx::broadcast(*local_, bo, ctx); });
      }
      if (!sends.empty()) waitGloo(sends, ctx);
      sends.clear();
    }
  } catch (const std::exception& e) {
    // Gloo may still write into (or read from) the chunks of a transfer given up on: its Work
    // holds the tensor, so the abandoned ones are kept for the process's life.
    keepAbandoned(works);
    keepAbandoned(sends);
    if (dynamic_cast<const Error*>(&e)) throw;
    failGloo(e, ctx);  // a p2p send posted to a closed connection
  }
  if (rank_ != root) finishAll(staged);
}

void Hierarchy::slicedAllgather(const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                const WaitContext& ctx) {
  const int H = layout_.numHosts, L = layout_.localSize;
  Staged in(input);
  at::Tensor inBytes = bytesOf(in.tensor());
  const int64_t b = inBytes.numel(), chunk = chunkElems(inBytes, b);
  std::vector<Staged> outs = stageAll(outputs, /*copyIn=*/false);
  // Chunk [off, off + len) of the output of the rank with local index p on host h.
  auto outChunk = [&](int h, int p, int64_t off, int64_t len) {
    return bytesOf(outs[layout_.hostRanks[h][p]].tensor()).narrow(0, off, len);
  };
  // Across hosts, hostBuf gets [H * off, H * (off + len)) = that chunk of the rank with this local
  // index on each host, in host order (with one rank per host, Gloo writes the outputs directly).
  // On the host, from kDirectGatherMin of output, each host's part of the chunk is gathered from
  // hostBuf straight into the outputs (one shared-memory all_gather per host); below it, the whole
  // chunk is gathered into a buffer in rank order at once and copied out (one synchronization
  // instead of H). Every chunk's Gloo all_gather is started first; each chunk is then gathered on
  // the host as soon as it has arrived.
  const bool direct = H * L * b >= kDirectGatherMin;
  at::Tensor hostBuf = L > 1 ? scratch(0, H * b, at::kByte) : at::Tensor();
  at::Tensor all = L > 1 && !direct ? scratch(1, L * H * b, at::kByte) : at::Tensor();
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (int64_t off = 0; off < b; off += chunk) {
    const int64_t len = std::min(chunk, b - off);
    std::vector<std::vector<at::Tensor>> ov(1);
    for (int h = 0; h < H; ++h) {
      ov[0].push_back(L > 1 ? hostBuf.narrow(0, H * off + h * len, len) : outChunk(h, 0, off, len));
    }
    std::vector<at::Tensor> iv{inBytes.narrow(0, off, len)};
    works.push_back(slice_->allgather(ov, iv));
  }
  for (int64_t off = 0, i = 0; off < b; off += chunk, ++i) {
    const int64_t len = std::min(chunk, b - off);
    waitGloo(works[i], ctx);
    if (L > 1 && !direct) {
      AllgatherOptions ag;
      ag.in = spanOf(hostBuf, H * off, H * len);
      for (int p = 0; p < L; ++p) ag.out.push_back(spanOf(all, p * H * b + H * off, H * len));
      runLocal([&] { tdx::allgather(*local_, ag, ctx); });
      for (int p = 0; p < L; ++p) {
        for (int h = 0; h < H; ++h) outChunk(h, p, off, len).copy_(all.narrow(0, p * H * b + H * off + h * len, len));
      }
      continue;
    }
    for (int h = 0; h < H && L > 1; ++h) {
      AllgatherOptions ag;
      ag.in = spanOf(hostBuf, H * off + h * len, len);
      for (int p = 0; p < L; ++p) ag.out.push_back(spanOf(outChunk(h, p, off, len), 0, len));
      runLocal([&] { tdx::allgather(*local_, ag, ctx); });
    }
  }
  finishAll(outs);
}

void Hierarchy::slicedReduceScatter(shm::ShmGroup& local, const at::Tensor& output,
                                    const std::vector<at::Tensor>& blocks, ReduceOp op, Agreement& a,
                                    const WaitContext& ctx) {
  const int H = layout_.numHosts, L = layout_.localSize, me = layout_.hostIndex;
  const int64_t m = output.numel(), chunk = chunkElems(output, m);
  const DataType dt = reduceDtype("reduce_scatter", output.scalar_type());
  const ReduceOp sumOp = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  // Chunk [off, off + len) of the blocks of host h's ranks: this host's ranks reduce-scatter it
  // straight from their inputs, so local rank p gets this host's partial of rank (h, p)'s chunk,
  // in partial[h]; it goes to host h, and fromHosts[h] gets host h's partial of this rank's chunk
  // (each byte crosses once). The other hosts' chunks go first, so the link starts early. With one
  // rank per host the partial is the input block itself.
  at::Tensor partial = L > 1 ? scratch(0, H * m, output.scalar_type()) : at::Tensor();
  at::Tensor fromHosts = scratch(1, H * m, output.scalar_type());
  auto partialOf = [&](int h, int64_t off, int64_t len) {
    return L > 1 ? partial.narrow(0, h * m + off, len) : blocks[layout_.hostRanks[h][0]].narrow(0, off, len);
  };
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  int tag = 0;
  for (int64_t off = 0; off < m; off += chunk, ++tag) {
    const int64_t len = std::min(chunk, m - off);
    for (int step = 1; step <= H; ++step) {
      const int h = (me + step) % H;
      if (L > 1) {
        ReduceScatterOptions rs;
        for (int p = 0; p < L; ++p) rs.in.push_back(spanOf(blocks[layout_.hostRanks[h][p]], off, len));
        rs.out = spanOf(partial, h * m + off, len);
        rs.dtype = dt;
        rs.op = sumOp;
        runFirstLocal(a, [&] { tdx::reduceScatter(local, rs, ctx); }, ctx);  // the check rides on the first
      }
      if (h == me) continue;
      std::vector<at::Tensor> s{partialOf(h, off, len)}, r{fromHosts.narrow(0, h * m + off, len)};
      works.push_back(slice_->send(s, h, tag));
      works.push_back(slice_->recv(r, h, tag));
    }
  }
  confirmAgree(a, ctx);  // empty blocks: no step carried the check
  for (auto& w : works) waitGloo(w, ctx);
  std::vector<const void*> parts;
  for (int h = 0; h < H; ++h) parts.push_back(h == me ? partialOf(me, 0, m).data_ptr() : fromHosts.narrow(0, h * m, m).data_ptr());
  at::Tensor result = output.is_contiguous() ? output.view({-1}) : at::empty({m}, output.options());
  reduceInto(result.data_ptr(), parts.data(), H, static_cast<size_t>(m), dt, sumOp);
  if (op == ReduceOp::kAvg) result.div_(size_);
  if (result.data_ptr() != output.data_ptr()) output.copy_(result.view(output.sizes()));
}

}  // namespace tdx
