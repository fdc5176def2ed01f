// all_reduce and reduce.
//
// One-shot (small messages): every rank copies its input into its buffer half, then every rank
// (or only the root) folds all ranks' halves in rank order (its own input read in place when it is
// one span). One synchronization.
//
// Reduce-scatter + all-gather (large messages), per round of up to one buffer half: every rank
// copies the other ranks' parts of the round into its half (its own part too when that lies across
// spans); rank r folds slice r of all halves in rank order, an all_reduce into its output (where the
// slice lies in one span) and from there into its own half, a reduce into its half; every rank (or
// only the root) copies the slices it does not hold yet out. Rounds alternate halves,
// so a rank copies in round k+1 while slower ranks still gather round k. Both algorithms fold in
// the same order on every rank, so results are bit-identical across ranks.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "collectives/chunking.h"
#include "collectives/collectives.h"
#include "collectives/op_desc.h"
#include "collectives/reduce_kernels.h"
#include "collectives/stream_copy.h"
#include "common/env.h"
#include "common/logging.h"
#include "tuning/plan.h"

namespace tdx {

namespace {

// TDX_PHASE_TIMES=1 (common/env.h): per-phase time of the reduce-scatter + all-gather rounds
// (one process-wide tally, for a single group's runs; off, it writes nothing).
struct PhaseTimes {
  static constexpr int kPhases = 6;
  const bool on = phaseTimes();
  double ns[kPhases] = {};
  long rounds = 0;
  std::chrono::steady_clock::time_point last;
  void start() {
    if (on) last = std::chrono::steady_clock::now();
  }
  void mark(int phase) {
    if (!on) return;
    const auto now = std::chrono::steady_clock::now();
    ns[phase] += std::chrono::duration<double, std::nano>(now - last).count();
    last = now;
    if (phase == kPhases - 1) ++rounds;
  }
  ~PhaseTimes() {
    if (!on || rounds == 0) return;
    static const char* names[kPhases] = {"acquire", "copy in", "wait copied", "fold", "wait reduced", "gather"};
    std::fprintf(stderr, "tdx phase times (pid %d, %ld rounds), us per round:", static_cast<int>(getpid()), rounds);
    for (int i = 0; i < kPhases; ++i) std::fprintf(stderr, " %s %.1f", names[i], ns[i] / 1e3 / rounds);
    std::fprintf(stderr, "\n");
  }
};
PhaseTimes phaseTimes;

// One fold of the op (or of the scaled sum) over n inputs.
void fold(const AllreduceOptions& o, void* out, const void* const* src, int n, size_t count) {
  if (o.scale != 1.0) {
    reduceScaledSumInto(out, src, n, count, o.dtype, o.scale);
  } else {
    reduceInto(out, src, n, count, o.dtype, o.op);
  }
}

// Folds `bytes` of the inputs `src` into `out` in blocks small enough to stay in the first-level
// cache, copying each block to `shared` right after (with `peer`): out and shared get the same bits.
// `at` is scratch of src.size() pointers (the caller's, so no allocation per round).
void foldAndPublish(const AllreduceOptions& o, char* out, char* shared, const std::vector<const void*>& src,
                    std::vector<const void*>& at, size_t bytes, const PeerCopy& peer) {
  // At least streamCopy's threshold, so the blocks stream where the store policy says so (only a
  // last partial block may take ordinary stores).
  constexpr size_t kBlock = 16u << 10;
  static_assert(kBlock >= tuning::kStreamMinBytes, "foldAndPublish's blocks must be large enough to stream");
  const size_t elem = elementSize(o.dtype);
  const int n = static_cast<int>(src.size());
  at.resize(n);
  for (size_t b = 0; b < bytes; b += kBlock) {
    const size_t len = std::min(kBlock, bytes - b);
    for (int r = 0; r < n; ++r) at[r] = static_cast<const char*>(src[r]) + b;
    fold(o, out + b, at.data(), n, len / elem);
    peer(shared + b, out + b, len);
  }
}

void checkAll(const ShmGroup& g, int h, const shm::OpDesc& mine) {
  for (int r = 0; r < g.size(); ++r) {
    if (r != g.rank()) checkDesc(g, r, h, mine);
  }
}

// The memory of bytes [off, off + len) of `spans` when they lie in one span, else nullptr.
char* contiguous(const SpanList& spans, size_t off, size_t len) {
  char* at = nullptr;
  spans.forEach(off, len, [&](char* p, size_t o, size_t bytes) {
    if (o == off && bytes == len) at = p;
  });
  return at;
}

void oneShot(ShmGroup& g, const AllreduceOptions& o, const shm::OpDesc& desc, const WaitContext& ctx) {
  const int n = g.size();
  const size_t elem = elementSize(o.dtype);
  const size_t total = o.in.total();
  const PeerCopy peer(PeerOp::kAllreduce, total, ctx.seq);
  const int h = acquireRound(g, /*first=*/true, desc, ctx);
  o.in.copyOut(0, total, g.half(g.rank(), h), peer);
  const uint32_t arrived = g.post();
  // A reduce's non-roots check too, so ranks that disagree on the root raise here on every rank.
  g.waitAll(arrived, ctx);
  checkAll(g, h, desc);
  if (o.root < 0 || o.root == g.rank()) {
    const void* ins[64];
    std::vector<const void*> many;
    const void** src = ins;
    if (n > 64) {
      many.resize(n);
      src = many.data();
    }
    // This rank's own input is read where the caller keeps it when it is one span (one tensor, or
    // a packed bucket): the fold of 2 x 64 KiB took 4.3 us that way against 7.0 us reading back the copy
    // just made in shared memory (2 ranks, Intel VM). Several spans may alias each other (the same
    // tensor twice in a coalesced call), and a fold writing one would change what the next reads,
    // so they read the shared copy.
    const char* mine = o.in.spans().size() == 1 ? o.in.spans()[0].ptr : nullptr;
    o.out.forEach(0, total, [&](char* p, size_t off, size_t bytes) {
      for (int r = 0; r < n; ++r) src[r] = r == g.rank() && mine ? mine + off : g.half(r, h) + off;
      fold(o, p, src, n, bytes / elem);
    });
  }
  g.releaseHalf(h, g.post());
}

void reduceScatterAllgather(ShmGroup& g, const AllreduceOptions& o, const shm::OpDesc& desc,
                            const WaitContext& ctx) {
  const int n = g.size();
  const int me = g.rank();
  const size_t elem = elementSize(o.dtype);
  const size_t total = o.in.total();
  const size_t maxSlice = slotBytes(g.halfBytes(), n);
  const bool gatherHere = o.root < 0 || o.root == me;
  std::vector<const void*> src(n), blockSrc(n);
  const PeerCopy peer(PeerOp::kAllreduce, total, ctx.seq);
  bool first = true;
  for (size_t off = 0; off < total || first;) {
    const size_t round = std::min(total - off, maxSlice * n);
    const size_t slice = roundUp((round + n - 1) / n, kSliceAlign);
    phaseTimes.start();
    const int h = acquireRound(g, first, desc, ctx);
    phaseTimes.mark(0);
    // Only this rank reads its own slice, so it stays in the caller's memory when it lies in one
    // span (saves a copy of 1/n of the message); the other slices go to shared memory.
    const size_t lo = std::min(round, slice * me), hi = std::min(round, slice * (me + 1));
    const char* ownSlice = lo < hi ? contiguous(o.in, off + lo, hi - lo) : nullptr;
    if (ownSlice) {
      o.in.copyOut(off, lo, g.half(me, h), peer);
      o.in.copyOut(off + hi, round - hi, g.half(me, h) + hi, peer);
    } else {
      o.in.copyOut(off, round, g.half(me, h), peer);
    }
    const uint32_t copied = g.post();
    phaseTimes.mark(1);
    g.waitAll(copied, ctx);
    if (first) checkAll(g, h, desc);
    phaseTimes.mark(2);
    // An all_reduce folds its slice straight into its output, block by block, and copies each block
    // to shared memory for the peers while it is still in the core's first-level cache: the slice
    // crosses memory twice (written to the output and to shared memory) instead of three times
    // (folded into shared memory, then copied out), and the gather skips it.
    char* ownOut = o.root < 0 && lo < hi ? contiguous(o.out, off + lo, hi - lo) : nullptr;
    if (lo < hi) {
      for (int r = 0; r < n; ++r) src[r] = r == me && ownSlice ? ownSlice : g.half(r, h) + lo;
      if (ownOut) {
        foldAndPublish(o, ownOut, g.half(me, h) + lo, src, blockSrc, hi - lo, peer);
      } else {
        fold(o, g.half(me, h) + lo, src.data(), n, (hi - lo) / elem);
      }
    }
    const uint32_t reduced = g.post();
    phaseTimes.mark(3);
    if (gatherHere) {
      g.waitAll(reduced, ctx);
      phaseTimes.mark(4);
      for (int p = 0; p < n; ++p) {
        const size_t plo = std::min(round, slice * p), phi = std::min(round, slice * (p + 1));
        if (plo < phi && !(p == me && ownOut)) o.out.copyIn(off + plo, phi - plo, g.half(p, h) + plo);
      }
    }
    g.releaseHalf(h, g.post());
    phaseTimes.mark(5);
    off += round;
    first = false;
  }
}

}  // namespace

void allreduce(ShmGroup& g, const AllreduceOptions& o, const WaitContext& ctx) {
  TDX_CHECK_EQ(o.in.total(), o.out.total());
  TDX_CHECK_EQ(o.in.total() % elementSize(o.dtype), 0u);
  TDX_ENFORCE(o.scale == 1.0 || (o.op == ReduceOp::kSum && isFloating(o.dtype)),
              "a scaled all_reduce (PREMUL_SUM) needs op SUM and a floating dtype");
  const bool isReduce = o.root >= 0;
  const shm::OpDesc desc = makeDesc(ctx, isReduce ? OpCode::kReduce : OpCode::kAllreduce, o.dtype, o.in.total(),
                                    o.root, o.op, true);
  // The plan's choice (tuning/plan.h), unless the caller forces one; one-shot only fits one half.
  const bool useOneShot =
      o.algorithm == AllreduceAlgorithm::kAuto
          ? tuning::allreduceOnHost(o.in.total(), g.size(), o.dtype, o.oneshotBytes, g.halfBytes()) ==
                tuning::HostAlgo::kOneShot
          : o.algorithm == AllreduceAlgorithm::kOneShot && o.in.total() <= g.halfBytes();
  if (useOneShot) {
    oneShot(g, o, desc, ctx);
  } else {
    reduceScatterAllgather(g, o, desc, ctx);
  }
}

}  // namespace tdx
