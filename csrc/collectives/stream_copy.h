// Copies into shared memory that a peer reads next, with non-temporal (streaming) or ordinary stores.
//
// A store to a cache line another core holds (a peer read it in the previous use of the buffer)
// must first invalidate that core's copy; ordinary stores (and glibc's `rep movsb`) wait for each
// of those invalidations, which on some placements of two virtual CPUs costs about 28 ns per line
// (256 KiB: 116 us instead of 5 us). Streaming stores write whole lines without that wait (9 us
// for the same 256 KiB); the peer then reads the lines from memory. See docs/performance.md
// ("The >= 1 MB slow mode").
#pragma once

#include <cstddef>
#include <cstdint>

#include "tuning/plan.h"

namespace tdx {

// Below tuning::kStreamMinBytes streamCopy is a plain memcpy; calls below tuning::kChooseMinBytes
// take ordinary stores without measuring (tuning/plan.h says why).

// memcpy(dst, src, n) with streaming stores for the 16-byte aligned bulk of dst (x86-64; plain
// memcpy elsewhere), followed by a store fence so the data is visible before a later release store.
void streamCopy(char* dst, const char* src, size_t n);

// The collectives that copy into shared memory for their peers, each with store choices of its own.
enum class PeerOp { kAllreduce, kAllgather, kReduceScatter, kBroadcast, kAlltoall, kScatter };

// How one collective call copies into shared memory that peers read next. TDX_SHM_STREAM
// (common/env.h) 1 or 0 forces streaming or ordinary stores (tuning::storesFor). Unset ("auto"), the call takes the
// kind under which calls of its op and size class (a power of two, from tuning::kChooseMinBytes) have
// taken less time per byte lately; one call in 32 is a trial of a kind chosen from `seq` alone,
// so about one in 64 tries the other kind, to see whether that changed. The time of the call,
// from construction to destruction, is noted for its kind where the call copied tuning::kStreamMinBytes
// or more at once (a broadcast's or scatter's root, not their readers; not when it unwinds with
// an exception). stream_copy.cc says why. Copies under tuning::kStreamMinBytes are plain memcpy either way.
// `seq` is the group's sequence number of the call: every rank of a group makes the same trials
// with the same kind of store.
class PeerCopy {
 public:
  PeerCopy(PeerOp op, size_t bytes, uint64_t seq);
  ~PeerCopy();
  PeerCopy(const PeerCopy&) = delete;
  PeerCopy& operator=(const PeerCopy&) = delete;

  // memcpy(dst, src, n), with streaming stores where this call uses them.
  void operator()(char* dst, const char* src, size_t n) const;

  bool streaming() const { return streaming_; }

  struct Costs;  // the times of one op and size class (stream_copy.cc)

 private:
  Costs* costs_ = nullptr;  // the class this call's time updates; null: forced or too small
  bool warming_ = false;  // one of the class's first calls: counted, not measured
  bool streaming_ = false;
  bool explore_ = false;
  size_t bytes_ = 0;
  uint64_t start_ = 0;
  int uncaught_ = 0;
  mutable bool copied_ = false;  // a copy of tuning::kStreamMinBytes or more happened
};

}  // namespace tdx
