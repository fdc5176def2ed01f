// all_gather and gather: per round of up to one buffer half, every rank copies its chunk into
// its half; every rank (or only the root) copies every peer's chunk out. Contributions may have
// different sizes; the number of rounds follows the largest.
//
// Single copy (an all_gather the plan gives it: from ShmGroup::singleCopyBytes() to 4 MiB of
// output, tuning/plan.cc says why): every rank publishes its input's address and reads the peers'
// inputs straight into its outputs (process_vm_readv): one copy of each peer's block instead of two
// through shared memory.
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>

#include "collectives/chunking.h"
#include "collectives/collectives.h"
#include "collectives/op_desc.h"
#include "collectives/stream_copy.h"
#include "common/logging.h"
#include "tuning/plan.h"

#include <cstring>

namespace tdx {

namespace {

// Reads len bytes at `remote` in rank r's memory into `local`.
void readPeer(ShmGroup& g, int r, const char* remote, char* local, size_t len, const WaitContext& ctx) {
  while (len > 0) {
    iovec l{local, len}, rm{const_cast<char*>(remote), len};
    const ssize_t got = process_vm_readv(g.pid(r), &l, 1, &rm, 1, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      const int err = got < 0 ? errno : 0;
      const std::string why = got < 0 ? std::strerror(err) : "nothing read";
      std::string gone = g.processGone(r);
      // ESRCH: the peer is exiting (its memory is gone) before /proc shows it dead or a zombie.
      if (gone.empty() && err == ESRCH) gone = str("rank ", g.info().describeRank(r), " (pid ", g.pid(r), ") exited");
      const std::string msg = str("tdx: ", ctx.op, " (sequence ", ctx.seq, ") in group '", g.info().name,
                                  "' could not read the input of rank ", g.info().describeRank(r), ": ",
                                  gone.empty() ? why : gone, " (TDX_SINGLE_COPY_BYTES=0 turns direct reads off)");
      g.markFailed(ctx, msg);
      throw Error(msg);
    }
    local += got;
    remote += got;
    len -= static_cast<size_t>(got);
  }
}

// Rank p's contribution must fit this rank's output slot for it (an all_gather's blocks may differ
// in size), and its descriptor must match this operation's.
void checkSlot(ShmGroup& g, int p, int h, const shm::OpDesc& desc, size_t slotBytes, const WaitContext& ctx) {
  const shm::OpDesc theirs = g.desc(p, h);
  if (theirs.seq == desc.seq && theirs.op == desc.op && theirs.bytes != slotBytes) {
    const std::string msg = str("tdx: mismatched sizes in ", ctx.op, " (sequence ", ctx.seq, ") in group '",
                                g.info().name, "': rank ", g.info().describeRank(g.rank()), "'s output tensor for rank ",
                                g.info().describeRank(p), " has ", slotBytes, " bytes but that rank's input has ",
                                theirs.bytes, " bytes. Each output tensor must have the size of that rank's input");
    g.markFailed(ctx, msg);
    throw Error(msg);
  }
  shm::OpDesc expect = desc;
  expect.bytes = slotBytes;
  checkDesc(g, p, h, expect);  // so what it published is its input to this operation
}

void singleCopyAllgather(ShmGroup& g, const AllgatherOptions& o, const shm::OpDesc& desc, const WaitContext& ctx) {
  const int n = g.size(), me = g.rank();
  const int h = acquireRound(g, /*first=*/true, desc, ctx, /*checkBytes=*/false);
  g.detail(me, h)[0] = reinterpret_cast<uint64_t>(o.in.ptr);
  const uint32_t published = g.post();
  // This rank's own block needs no peer: copied while the peers publish theirs.
  if (o.in.bytes) std::memcpy(o.out[me].ptr, o.in.ptr, o.in.bytes);
  g.waitAll(published, ctx);
  for (int p = 0; p < n; ++p) {
    if (p != me) checkSlot(g, p, h, desc, o.out[p].bytes, ctx);
  }
  for (int p = 0; p < n; ++p) {
    if (p != me) readPeer(g, p, reinterpret_cast<const char*>(g.detail(p, h)[0]), o.out[p].ptr, o.out[p].bytes, ctx);
  }
  // The peers read this rank's input until they post this step.
  const uint32_t done = g.post();
  g.waitAll(done, ctx);
  g.releaseHalf(h, done);
}

}  // namespace

void allgather(ShmGroup& g, const AllgatherOptions& o, const WaitContext& ctx) {
  const int n = g.size();
  const int me = g.rank();
  const bool isGather = o.root >= 0;
  const bool receives = !isGather || o.root == me;
  size_t maxBytes = o.in.bytes;
  if (receives) {
    TDX_CHECK_EQ(o.out.size(), static_cast<size_t>(n));
    TDX_CHECK_EQ(o.out[me].bytes, o.in.bytes);  // callers check it (the own block is copied before the wait)
    for (const Span& s : o.out) maxBytes = std::max(maxBytes, s.bytes);
  }
  shm::OpDesc desc =
      makeDesc(ctx, isGather ? OpCode::kGather : OpCode::kAllgather, DataType::kBytes, o.in.bytes, o.root);
  desc.aux = maxBytes;  // a gather's root publishes its largest block: non-roots run as many rounds
  size_t outBytes = 0;
  for (const Span& s : o.out) outBytes += s.bytes;
  if (!isGather && tuning::singleCopyAllgather(outBytes, n, g.singleCopyBytes())) {
    return singleCopyAllgather(g, o, desc, ctx);
  }
  const size_t chunk = g.halfBytes();
  const PeerCopy peer(PeerOp::kAllgather, o.in.bytes, ctx.seq);
  bool first = true;
  for (size_t off = 0; off < maxBytes || first;) {
    // A gather's blocks all have the root's size; an all_gather's may differ (checked per slot).
    const int h = acquireRound(g, first, desc, ctx, /*checkBytes=*/isGather);
    const size_t mine = clampChunk(o.in.bytes, off, chunk);
    if (mine) peer(g.half(me, h), o.in.ptr + off, mine);
    const uint32_t filled = g.post();
    if (receives) {
      // This rank's own chunk needs no peer: copied while the peers fill their halves.
      const size_t own = clampChunk(o.out[me].bytes, off, chunk);
      if (own) std::memcpy(o.out[me].ptr + off, o.in.ptr + off, own);
      g.waitAll(filled, ctx);
      for (int p = 0; p < n; ++p) {
        if (p == me) continue;
        if (first) checkSlot(g, p, h, desc, o.out[p].bytes, ctx);
        const size_t bytes = clampChunk(o.out[p].bytes, off, chunk);
        if (bytes) std::memcpy(o.out[p].ptr + off, g.half(p, h), bytes);
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
