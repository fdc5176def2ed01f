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
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
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
  // A hash of (op, dtype, root, reduce op) of every earlier collective this rank ran in this group:
  // ranks whose histories differ disagreed on an earlier rooted collective that did not make them
  // wait for each other (two ranks both claiming a broadcast's root, say).
  uint64_t history;
};

// Set by a rank whose collective failed (mismatch, timeout, dead peer, abort): its step counter
// stops, so peers waiting for it read why instead of waiting for the timeout. Also set by a rank
// whose process is failing (failure_notice.h), before it unwinds.
struct alignas(64) FailureNote {
  // kCollectiveFailed or kProcessFailing, maybe with the kGroupAborted flag (failure_notice.h), written last (release): reason and
  // seq are valid when set
  std::atomic<uint32_t> failed{0};
  uint64_t seq = 0;
  char reason[448] = {0};
};

// Set by a rank that refused a collective's arguments before taking any step of it (a gather list
// of the wrong length on one rank, say). Peers waiting in that very collective raise quoting it;
// later collectives ignore it, so when every rank refused the same call nobody waits for it and the
// group goes on.
struct alignas(64) RefusalNote {
  std::atomic<uint64_t> seq{0};  // 1 + the refused collective's sequence number; written last (release)
  char reason[448] = {0};
};

// Set by a peer when the survivors exclude this rank (it made no progress for the stuck time, or a
// shrink left it out): a fence. Every later operation of the rank on this group fails quoting it.
struct alignas(64) ExclusionNote {
  std::atomic<uint32_t> state{0};  // 0: none; 1: being written (a peer claimed it); 2: reason valid (release)
  char reason[440] = {0};
};

struct alignas(64) RankHeader {
  uint64_t magic;
  int32_t rank;
  int32_t size;
  int32_t pid;
  int32_t fullChecks;  // this rank asked for full mismatch checks (TDX_DEBUG / TORCH_DISTRIBUTED_DEBUG)
  std::atomic<int32_t> cpu;  // the CPU this rank last waited on (written only when it changes)
  uint64_t selfAddr;  // where this rank mapped this header, in its own address space
  // From which all_gather size this rank reads its peers' inputs directly (collectives/allgather.cc);
  // 0: it cannot (no permission, another pid namespace) or TDX_SINGLE_COPY_BYTES=0. Final once
  // this rank has mapped every peer's segment.
  uint64_t singleCopyBytes;
  Doorbell step;     // word = number of collective steps this rank has posted
  Doorbell bell;     // p2p doorbell: rung when data or space may be available to this rank
  alignas(64) OpDesc desc[2];
  OpDesc prevRooted;   // the last collective with a root this rank ran before the current one
  // 1 + the sequence number of the last collective this rank finished, posted by the engines of
  // groups spanning hosts only (a host mate's later exit cannot hold up an operation it finished).
  alignas(64) std::atomic<uint64_t> finished{0};
  FailureNote failure;
  RefusalNote refusal;
  // When this rank last showed progress (CLOCK_MONOTONIC ns, one clock for the host): it entered a
  // collective, waited in one, waited on a p2p operation, or its trainer finished a step. A rank
  // silent past the group's stuck time while a peer waits on it is excluded (`excluded`).
  alignas(64) std::atomic<int64_t> progressNs{0};
  // How long this rank may show no progress before a peer waiting on it excludes it (ms; 0: never,
  // the default). Set by the rank itself (an elastic trainer), so a rank that has not armed the
  // watch, still starting or outside any trainer, is never excluded.
  std::atomic<int64_t> stuckMs{0};
  ExclusionNote excluded;
  // Keys a rank publishes while the survivors of this group form a smaller one (shrink.h).
  struct alignas(64) MailboxSlot {
    std::atomic<uint32_t> gen{0};  // the shrink this entry belongs to; written last (release)
    char key[60];
    char value[192];
  } mailbox[4];
};

// Producer/consumer positions of a p2p byte ring (src -> dst), in the sender's segment.
struct alignas(64) RingCtl {
  std::atomic<uint64_t> head;  // bytes written by the sender
  char pad_[56];
  std::atomic<uint64_t> tail;  // bytes consumed by the receiver
  char pad2_[56];
  // Non-zero once the ring can no longer be trusted: a message in it was abandoned half-written
  // (kSenderAbandoned) or half-read (kReceiverAbandoned), or the receive it matched had another
  // dtype or size (kReceiverRejected, described by `rejected`). Later operations on the pair fail.
  std::atomic<uint32_t> broken;
  struct {
    int32_t tag, sentDtype, recvDtype;
    uint64_t sentBytes, recvBytes;
  } rejected;  // written by the receiver before it sets `broken` (release)
  char pad3_[24];
};
static_assert(sizeof(RingCtl) == 192, "RingCtl is three cache lines");
constexpr uint32_t kSenderAbandoned = 1;
constexpr uint32_t kReceiverAbandoned = 2;
constexpr uint32_t kReceiverRejected = 3;

struct ShmOptions {
  size_t halfBytes = 512u << 10;  // each of the two collective buffer halves
  size_t ringBytes = 1u << 20;   // each p2p ring
  WaitPolicy wait;
  // Full mismatch checks (an extra synchronization per collective where every rank compares its
  // descriptor with every other's): 1 on, 0 off, -1 from TDX_DEBUG / TORCH_DISTRIBUTED_DEBUG=DETAIL.
  // On in the whole group as soon as one rank asks for it.
  int fullChecks = -1;
  // From which all_gather size this rank offers to read peers' memory directly; -1: from
  // TDX_SINGLE_COPY_BYTES, 0: never. The group takes the largest offer, or none if a rank has 0.
  int64_t singleCopyBytes = -1;
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
  // Per-half scratch of 2 x size() words next to the descriptor (all_to_all's split sizes).
  uint64_t* detail(int r, int h) const { return details_[r] + static_cast<size_t>(h) * 2 * info_.size; }
  bool fullChecks() const { return fullChecks_; }
  // From which all_gather size this group reads peers' memory directly (process_vm_readv); 0 when
  // some rank cannot. The same on every rank.
  size_t singleCopyBytes() const { return singleCopyBytes_; }
  int pid(int r) const { return headers_[r]->pid; }
  // Running state of the descriptors this rank published (see OpDesc::history), kept by the
  // collectives layer.
  uint64_t& descHistory() { return descHistory_; }
  OpDesc& lastRooted() { return lastRooted_; }
  OpDesc& prevRooted(int r) const { return headers_[r]->prevRooted; }

  // Posts the next step of this rank; returns its number.
  uint32_t post();
  // Number of steps this rank has posted.
  uint32_t posted() const { return posted_; }
  // Waits until every rank (or rank r) has posted step `target`; throws on timeout or abort.
  void waitAll(uint32_t target, const WaitContext& ctx);
  void waitRank(int r, uint32_t target, const WaitContext& ctx);

  // Picks the next buffer half and waits until every rank has finished reading it. Throws at
  // once if an earlier collective of this rank failed (the ranks' steps no longer line up).
  int acquireHalf(const WaitContext& ctx);

  // Records that collective `ctx` failed on this rank with `reason`: later collectives here fail
  // at once, and peers waiting for this rank fail within milliseconds quoting `reason`.
  void markFailed(const WaitContext& ctx, const std::string& reason) const;
  // "" while rank r's process runs; otherwise "rank r (pid P) exited". Same host only; a peer
  // whose pid this process cannot see (another pid namespace) is never reported dead.
  std::string peerDeath(int r) const;
  // "" unless rank r marked a collective failed; otherwise what it reported.
  std::string peerFailure(int r) const;
  // Records that this rank refused collective `ctx` before taking a step of it: peers waiting in
  // that collective fail within milliseconds quoting `reason`; this rank's group stays usable.
  void postRefusal(const WaitContext& ctx, const std::string& reason) const;
  // "" unless rank r refused collective `seq`; otherwise what it reported.
  std::string peerRefusal(int r, uint64_t seq) const;
  // "" while rank r's process runs and has not announced that it is failing (failure_notice.h);
  // otherwise why it is gone. A rank whose collective failed but whose process goes on is alive.
  std::string processGone(int r) const;
  // Records that this rank finished collective `seq` (release), and whether rank r finished `seq`.
  void postFinished(uint64_t seq) const { headers_[info_.rank]->finished.store(seq + 1, std::memory_order_release); }
  bool peerFinished(int r, uint64_t seq) const { return headers_[r]->finished.load(std::memory_order_acquire) > seq; }
  // "" unless rank r aborted this group (abort(), destroy, a shrink with SHRINK_ABORT); then what
  // a p2p operation with it says: it will neither send nor receive on this group again.
  std::string peerAborted(int r) const;

  // Stuck ranks. This rank's stuck time (0: off, the default; elastic trainers set it): once set,
  // a peer waiting on this rank excludes it when it has shown no progress for that long.
  void setStuckTimeout(std::chrono::milliseconds t) const {
    headers_[info_.rank]->stuckMs.store(t.count(), std::memory_order_release);
  }
  std::chrono::milliseconds stuckTimeout() const {
    return std::chrono::milliseconds(headers_[info_.rank]->stuckMs.load(std::memory_order_acquire));
  }
  // Records progress of this rank (its header and the process's mark, noteProcessProgress()).
  void noteProgress() const;
  // "" unless rank r was excluded (fenced); then why ("rank 2 (pid 42) was excluded ...").
  std::string excludedWhy(int r) const;
  // Fences rank r with `reason` unless it is fenced already (the first reason stays); wakes it.
  void exclude(int r, const std::string& reason) const;
  // excludedWhy(r), after fencing r when r set a stuck time and has shown no progress for it.
  std::string peerStuck(int r) const;
  // Throws ExcludedError when this rank was excluded from the group (its operation `ctx`).
  void checkNotExcluded(const WaitContext& ctx) const;
  // The header of rank r (its mailbox serves the shrink rendezvous, shrink.cc).
  RankHeader& header(int r) const { return *headers_[r]; }
  // The number of the next shrink of this group (every survivor counts its shrinks alike).
  uint32_t nextShrink() { return ++shrinks_; }
  // Marks that half `h` is free for reuse once every rank has posted step `step`.
  void releaseHalf(int h, uint32_t step) { release_[h] = step; }

  // p2p rings: the ring carrying bytes from `src` to `dst` lives in src's segment.
  RingCtl& ringCtl(int src, int dst) const { return ringCtls_[src][dst]; }
  char* ringData(int src, int dst) const { return rings_[src] + static_cast<size_t>(dst) * opts_.ringBytes; }
  size_t ringBytes() const { return opts_.ringBytes; }
  Doorbell& bell(int r) const { return headers_[r]->bell; }

  // Makes every current and future wait fail promptly with AbortedError, and flags this rank's
  // header kGroupAborted so that peers whose p2p operation waits on it fail at their next probe
  // instead of at the timeout. `reason`, when given (an interrupt: which ranks went silent), is
  // what the interrupted waits say instead of "shut down or aborted".
  void abort(const std::string& reason = "");
  bool aborted() const { return aborted_.load(std::memory_order_relaxed); }
  // The reason given to abort() ("" when none was).
  std::string abortReason() const;
  const std::atomic<bool>* abortFlag() const { return &aborted_; }

 private:
  // The policy for a wait on rank r: no spinning when r last ran on this very CPU (the scheduler
  // put both ranks on one core: spinning would only keep r from running), else the group's.
  const WaitPolicy& policyFor(int r);
  bool reached(int r, uint32_t target) const {
    return static_cast<int32_t>(headers_[r]->step.word.load(std::memory_order_acquire) - target) >= 0;
  }
  [[noreturn]] void throwWaitFailure(WaitResult res, const std::vector<int>& waitedFor, uint32_t target,
                                     const WaitContext& ctx) const;
  // Whether any rank in `ranks` that has not reached `target` died, failed, or refused collective
  // `seq` (sleep phase only).
  bool anyMissingPeerGone(const int* ranks, int count, uint32_t target, uint64_t seq) const;

  GroupInfo info_;
  ShmOptions opts_;
  size_t segBytes_ = 0;
  std::vector<Segment> segments_;
  std::vector<RankHeader*> headers_;
  std::vector<RingCtl*> ringCtls_;
  std::vector<char*> halves_;
  std::vector<char*> rings_;
  std::vector<uint64_t*> details_;
  std::vector<long long> peerStart_;  // process start time of each rank's pid; -1: cannot watch
  bool fullChecks_ = false;
  size_t singleCopyBytes_ = 0;
  uint64_t descHistory_ = 0;
  OpDesc lastRooted_{};
  mutable std::string failedReason_;  // set once a collective of this rank failed
  WaitPolicy noSpin_;  // opts_.wait without its spin phase
  uint32_t posted_ = 0;
  uint32_t shrinks_ = 0;
  uint32_t release_[2] = {0, 0};
  int nextHalf_ = 0;
  std::atomic<bool> aborted_{false};
  mutable std::mutex abortMu_;
  std::string abortReason_;  // abort()'s reason, under abortMu_
};

}  // namespace tdx::shm
