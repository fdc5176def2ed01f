// The shared-memory transport for one process group on one host.
//
// Every rank owns one segment: a header (a step counter that is also a futex word, a p2p
// doorbell, per-half operation descriptors), per-destination p2p ring controls, a collective
// buffer of two halves, and one p2p ring per destination. All ranks map all segments.
//
// Collectives synchronize through the step counters: each rank executes the same sequence of
// steps, so "rank r finished step k" is "counter of r >= k". A half of the collective buffer is
// reused only after every rank posted the step that ended its last read of it.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "transport/shm/futex_wait.h"
#include "transport/shm/segment.h"
#include "transport/transport.h"

namespace tdx::shm {

// What a rank says about the collective it is running, so peers can detect mismatches.
struct OpDesc {
  uint64_t seq;
  uint32_t op;
  uint32_t dtype;
  uint64_t bytes;
  int32_t root;
  int32_t redop;
  uint64_t aux;
};

struct alignas(64) RankHeader {
  uint64_t magic;
  int32_t rank;
  int32_t size;
  int32_t pid;
  Doorbell step;     // word = number of collective steps this rank has posted
  Doorbell bell;     // p2p doorbell: rung when data or space may be available to this rank
  alignas(64) OpDesc desc[2];
};

// Producer/consumer positions of a p2p byte ring (src -> dst), in the sender's segment.
struct alignas(64) RingCtl {
  std::atomic<uint64_t> head;  // bytes written by the sender
  char pad_[56];
  std::atomic<uint64_t> tail;  // bytes consumed by the receiver
  char pad2_[56];
};

struct ShmOptions {
  size_t halfBytes = 512u << 10;  // each of the two collective buffer halves
  size_t ringBytes = 1u << 20;   // each p2p ring
  WaitPolicy wait;
};

class ShmGroup {
 public:
  // Creates this rank's segment, exchanges names through `rdv`, maps every peer's segment,
  // then unlinks its own once every rank has mapped it.
  ShmGroup(const GroupInfo& info, Rendezvous& rdv, const ShmOptions& opts);
  ~ShmGroup();
  ShmGroup(const ShmGroup&) = delete;
  ShmGroup& operator=(const ShmGroup&) = delete;

  int rank() const { return info_.rank; }
  int size() const { return info_.size; }
  const GroupInfo& info() const { return info_; }
  const ShmOptions& options() const { return opts_; }

  // Collective buffer half `h` (0 or 1) of rank `r`.
  char* half(int r, int h) const { return halves_[r] + static_cast<size_t>(h) * opts_.halfBytes; }
  size_t halfBytes() const { return opts_.halfBytes; }
  OpDesc& desc(int r, int h) const { return headers_[r]->desc[h]; }

  // Posts the next step of this rank; returns its number.
  uint32_t post();
  // Number of steps this rank has posted.
  uint32_t posted() const { return posted_; }
  // Waits until every rank (or rank r) has posted step `target`; throws on timeout or abort.
  void waitAll(uint32_t target, const WaitContext& ctx);
  void waitRank(int r, uint32_t target, const WaitContext& ctx);

  // Picks the next buffer half and waits until every rank has finished reading it.
  int acquireHalf(const WaitContext& ctx);
  // Marks that half `h` is free for reuse once every rank has posted step `step`.
  void releaseHalf(int h, uint32_t step) { release_[h] = step; }

  // p2p rings: the ring carrying bytes from `src` to `dst` lives in src's segment.
  RingCtl& ringCtl(int src, int dst) const { return ringCtls_[src][dst]; }
  char* ringData(int src, int dst) const { return rings_[src] + static_cast<size_t>(dst) * opts_.ringBytes; }
  size_t ringBytes() const { return opts_.ringBytes; }
  Doorbell& bell(int r) const { return headers_[r]->bell; }

  // Makes every current and future wait fail promptly with AbortedError.
  void abort();
  bool aborted() const { return aborted_.load(std::memory_order_relaxed); }
  const std::atomic<bool>* abortFlag() const { return &aborted_; }

 private:
  bool reached(int r, uint32_t target) const {
    return static_cast<int32_t>(headers_[r]->step.word.load(std::memory_order_acquire) - target) >= 0;
  }
  [[noreturn]] void throwWaitFailure(WaitResult res, const std::vector<int>& waitedFor, uint32_t target,
                                     const WaitContext& ctx) const;

  GroupInfo info_;
  ShmOptions opts_;
  size_t segBytes_ = 0;
  std::vector<Segment> segments_;
  std::vector<RankHeader*> headers_;
  std::vector<RingCtl*> ringCtls_;
  std::vector<char*> halves_;
  std::vector<char*> rings_;
  uint32_t posted_ = 0;
  uint32_t release_[2] = {0, 0};
  int nextHalf_ = 0;
  std::atomic<bool> aborted_{false};
};

}  // namespace tdx::shm
