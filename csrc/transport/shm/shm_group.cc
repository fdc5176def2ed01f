#include "transport/shm/shm_group.h"

#include <sched.h>
#include <sys/uio.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <new>
#include <thread>

#include "common/env.h"
#include "common/logging.h"
#include "common/round_up.h"
#include "tuning/plan.h"
#include "transport/shm/failure_notice.h"

namespace tdx::shm {

namespace {

// Changed with the header layout, so ranks of different builds refuse each other's segments.
constexpr uint64_t kMagic = 0x7464785f73686d33ull;  // "tdx_shm3"
constexpr size_t kPage = 4096;


struct Layout {
  size_t ringCtlOff, detailOff, halvesOff, ringsOff, total;
};

Layout layoutFor(int size, const ShmOptions& o) {
  Layout l;
  l.ringCtlOff = roundUp(sizeof(RankHeader), kPage);
  l.detailOff = roundUp(l.ringCtlOff + sizeof(RingCtl) * static_cast<size_t>(size), 64);
  l.halvesOff = roundUp(l.detailOff + 2 * 2 * sizeof(uint64_t) * static_cast<size_t>(size), kPage);
  l.ringsOff = l.halvesOff + 2 * roundUp(o.halfBytes, kPage);
  l.total = l.ringsOff + static_cast<size_t>(size) * roundUp(o.ringBytes, kPage);
  return l;
}

// State and start time (field 22, clock ticks since boot) of process `pid` from /proc/<pid>/stat.
// Returns false when the process does not exist (any more).
// Whether this process can read peer memory through process_vm_readv: reads the peer's header at
// the address the peer mapped it and compares it with the shared copy, so a pid that names another
// process (another pid namespace) does not pass.
bool canReadMemoryOf(const RankHeader& peer) {
  struct {
    uint64_t magic;
    int32_t rank, size, pid;
  } seen{};  // RankHeader's first fields
  iovec local{&seen, sizeof(seen)};
  iovec remote{reinterpret_cast<void*>(peer.selfAddr), sizeof(seen)};
  if (process_vm_readv(peer.pid, &local, 1, &remote, 1, 0) != static_cast<ssize_t>(sizeof(seen))) return false;
  return seen.magic == peer.magic && seen.rank == peer.rank && seen.size == peer.size && seen.pid == peer.pid;
}

bool readProcStat(int pid, char* state, long long* start) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return false;
  char buf[1024];
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* p = std::strrchr(buf, ')');  // the command name may hold spaces and parentheses
  if (!p) return false;
  char st = 0;
  long long fields[19];
  // After ")": state, then fields 4..22; the 19th of those is starttime.
  int got = std::sscanf(p + 1, " %c %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld",
                        &st, &fields[0], &fields[1], &fields[2], &fields[3], &fields[4], &fields[5], &fields[6],
                        &fields[7], &fields[8], &fields[9], &fields[10], &fields[11], &fields[12], &fields[13],
                        &fields[14], &fields[15], &fields[16], &fields[17], &fields[18]);
  if (got < 20) return false;
  *state = st;
  *start = fields[18];
  return true;
}

}  // namespace

ShmGroup::ShmGroup(const GroupInfo& info, Rendezvous& rdv, const ShmOptions& opts) : info_(info), opts_(opts) {
  TDX_ENFORCE(info.size >= 1 && info.rank >= 0 && info.rank < info.size, "invalid rank ", info.rank,
              " for a group of size ", info.size);
  TDX_ENFORCE(opts.halfBytes >= 4096 && opts.halfBytes % 64 == 0, "collective buffer half of ", opts.halfBytes,
              " bytes must be a multiple of 64 and at least 4096");
  TDX_ENFORCE(opts.ringBytes >= 4096 && opts.ringBytes % 64 == 0, "p2p ring of ", opts.ringBytes,
              " bytes must be a multiple of 64 and at least 4096");
  TDX_ENFORCE(opts.halfBytes >= 64 * static_cast<size_t>(info.size), "collective buffer half of ", opts.halfBytes,
              " bytes is too small for ", info.size, " ranks; set TDX_BUFFER_BYTES to at least ", 64 * info.size);
  opts_.halfBytes = roundUp(opts.halfBytes, kPage);
  opts_.ringBytes = roundUp(opts.ringBytes, kPage);
  const int n = info.size;
  const Layout layout = layoutFor(n, opts_);
  segBytes_ = layout.total;

  removeStaleSegments();
  segments_.resize(n);
  segments_[info.rank] = Segment::create(segBytes_);
  auto* own = new (segments_[info.rank].data()) RankHeader();
  own->magic = kMagic;
  own->rank = info.rank;
  own->size = n;
  own->pid = static_cast<int32_t>(getpid());
  own->fullChecks = (opts.fullChecks < 0 ? env().debug : opts.fullChecks != 0) ? 1 : 0;
  own->cpu.store(-1, std::memory_order_relaxed);
  own->selfAddr = reinterpret_cast<uint64_t>(own);
  own->singleCopyBytes = 0;
  noSpin_ = opts_.wait;
  noSpin_.spinTime = std::chrono::microseconds(0);
  for (int d = 0; d < n; ++d) {
    new (segments_[info.rank].data() + layout.ringCtlOff + d * sizeof(RingCtl)) RingCtl();
  }

  rdv.set(str("tdx/seg/", info.rank), segments_[info.rank].name());
  for (int r = 0; r < n; ++r) {
    if (r == info.rank) continue;
    segments_[r] = Segment::open(rdv.get(str("tdx/seg/", r)), segBytes_);
  }
  // Offer direct reads when this rank can read every peer's memory; the offers are final before
  // the "mapped" keys, so every rank computes the same group threshold below.
  // The default offer is the plan's (tuning/plan.cc says why).
  const size_t dflt = tuning::singleCopyOffer(n, cpuIsAmd(), env().singleCopyBytes);
  const int64_t offer = opts.singleCopyBytes < 0 ? static_cast<int64_t>(dflt) : opts.singleCopyBytes;
  bool readable = offer > 0;
  for (int r = 0; r < n && readable; ++r) {
    if (r != info.rank) readable = canReadMemoryOf(*reinterpret_cast<RankHeader*>(segments_[r].data()));
  }
  own->singleCopyBytes = readable ? static_cast<uint64_t>(offer) : 0;
  rdv.set(str("tdx/mapped/", info.rank), "1");
  for (int r = 0; r < n; ++r) {
    if (r != info.rank) rdv.get(str("tdx/mapped/", r));
  }
  // Every rank has mapped our segment: the name is no longer needed.
  segments_[info.rank].unlink();

  bool everyOffers = true;  // the single-copy all_gather: every rank's offer, the largest taken
  size_t largestOffer = 0;
  for (int r = 0; r < n; ++r) {
    char* base = segments_[r].data();
    auto* h = reinterpret_cast<RankHeader*>(base);
    TDX_ENFORCE(h->magic == kMagic && h->rank == r && h->size == n, "peer segment of rank ", r,
                " is not a tdx segment of this group (magic/rank/size mismatch)");
    headers_.push_back(h);
    ringCtls_.push_back(reinterpret_cast<RingCtl*>(base + layout.ringCtlOff));
    halves_.push_back(base + layout.halvesOff);
    rings_.push_back(base + layout.ringsOff);
    details_.push_back(reinterpret_cast<uint64_t*>(base + layout.detailOff));
    fullChecks_ = fullChecks_ || h->fullChecks != 0;
    everyOffers = everyOffers && h->singleCopyBytes != 0;
    largestOffer = std::max<size_t>(largestOffer, h->singleCopyBytes);
    // Every peer is alive now (it just mapped our segment): remember its start time, so a dead
    // peer, a zombie, or a reused pid is recognized later. A pid we cannot see is not watched.
    char state = 0;
    long long start = -1;
    if (r == info.rank || !readProcStat(h->pid, &state, &start)) start = -1;
    peerStart_.push_back(start);
  }
  singleCopyBytes_ = everyOffers ? largestOffer : 0;
  noteProgress();
  registerOwnHeader(headers_[info.rank]);
}

ShmGroup::~ShmGroup() { unregisterOwnHeader(headers_[info_.rank]); }

uint32_t ShmGroup::post() {
  Doorbell& d = headers_[info_.rank]->step;
  ++posted_;
  d.word.store(posted_, std::memory_order_seq_cst);
  wakeSleepers(d);
  return posted_;
}

const WaitPolicy& ShmGroup::policyFor(int r) {
  const int cpu = sched_getcpu();
  std::atomic<int32_t>& mine = headers_[info_.rank]->cpu;
  if (mine.load(std::memory_order_relaxed) != cpu) mine.store(cpu, std::memory_order_relaxed);
  return cpu >= 0 && headers_[r]->cpu.load(std::memory_order_relaxed) == cpu ? noSpin_ : opts_.wait;
}

void ShmGroup::waitRank(int r, uint32_t target, const WaitContext& ctx) {
  if (reached(r, target)) return;
  WaitResult res = waitUntil([&] { return reached(r, target); }, headers_[r]->step, ctx.deadline, &aborted_,
                             policyFor(r), [&] { return anyMissingPeerGone(&r, 1, target, ctx.seq); });
  if (res != WaitResult::kReady) throwWaitFailure(res, {r}, target, ctx);
}

void ShmGroup::waitAll(uint32_t target, const WaitContext& ctx) {
  for (int r = 0; r < info_.size; ++r) {
    if (r == info_.rank || reached(r, target)) continue;
    // While sleeping on r, watch every rank still missing: r may itself wait for a dead one.
    WaitResult res = waitUntil([&] { return reached(r, target); }, headers_[r]->step, ctx.deadline, &aborted_,
                               policyFor(r), [&] { return anyMissingPeerGone(nullptr, info_.size, target, ctx.seq); });
    if (res != WaitResult::kReady) {
      std::vector<int> all(info_.size);
      for (int i = 0; i < info_.size; ++i) all[i] = i;
      throwWaitFailure(res, all, target, ctx);
    }
  }
}

bool ShmGroup::anyMissingPeerGone(const int* ranks, int count, uint32_t target, uint64_t seq) const {
  // Waiting is progress (this rank is held up by others); being excluded ends every wait.
  noteProgress();
  if (!excludedWhy(info_.rank).empty()) return true;
  for (int i = 0; i < count; ++i) {
    const int r = ranks ? ranks[i] : i;
    if (r == info_.rank || reached(r, target)) continue;
    if ((headers_[r]->failure.failed.load(std::memory_order_acquire) & ~kGroupAborted) != 0 ||
        headers_[r]->refusal.seq.load(std::memory_order_acquire) == seq + 1 || !peerDeath(r).empty() ||
        !peerStuck(r).empty()) {
      return true;
    }
  }
  return false;
}

void ShmGroup::postRefusal(const WaitContext& ctx, const std::string& reason) const {
  RefusalNote& note = headers_[info_.rank]->refusal;
  note.seq.store(0, std::memory_order_release);  // a peer reading the reason now finds no note
  const size_t n = std::min(reason.size(), sizeof(note.reason) - 1);
  std::memcpy(note.reason, reason.data(), n);
  note.reason[n] = '\0';
  note.seq.store(ctx.seq + 1, std::memory_order_release);
  // Peers waiting for this rank sleep on its step word: wake them so they look sooner.
  futexWakeAll(&headers_[info_.rank]->step.word);
}

std::string ShmGroup::peerRefusal(int r, uint64_t seq) const {
  if (r == info_.rank) return "";
  const RefusalNote& note = headers_[r]->refusal;
  if (note.seq.load(std::memory_order_acquire) != seq + 1) return "";
  const std::string reason(note.reason, strnlen(note.reason, sizeof(note.reason)));
  // Read again: a later refusal may have rewritten the reason meanwhile.
  if (note.seq.load(std::memory_order_acquire) != seq + 1) return "";
  return str("rank ", info_.describeRank(r), " refused the call: ", reason);
}

std::string ShmGroup::peerDeath(int r) const {
  if (r == info_.rank || peerStart_[r] < 0) return "";
  const int pid = headers_[r]->pid;
  bool dead = kill(pid, 0) != 0 && errno == ESRCH;
  if (!dead) {
    // A killed child stays a zombie until its parent reaps it; a recycled pid has a new start time.
    char state = 0;
    long long start = -1;
    dead = !readProcStat(pid, &state, &start) || state == 'Z' || state == 'X' || start != peerStart_[r];
  }
  return dead ? str("rank ", info_.describeRank(r), " (pid ", pid, ") exited") : "";
}

std::string ShmGroup::peerFailure(int r) const {
  const FailureNote& f = headers_[r]->failure;
  const uint32_t failed = r == info_.rank ? 0 : f.failed.load(std::memory_order_acquire) & ~kGroupAborted;
  if (failed == 0) return "";
  const std::string reason(f.reason, strnlen(f.reason, sizeof(f.reason)));
  if (failed == kProcessFailing) {
    return str("rank ", info_.describeRank(r), " (pid ", headers_[r]->pid, ") failed: ", reason);
  }
  return str("rank ", info_.describeRank(r), " failed [", reason, "]");
}

std::string ShmGroup::processGone(int r) const {
  // The process's own notice says why; a collective's failure note does not mean it is gone.
  if (r != info_.rank &&
      (headers_[r]->failure.failed.load(std::memory_order_acquire) & ~kGroupAborted) == kProcessFailing) {
    return peerFailure(r);
  }
  return peerDeath(r);
}

void ShmGroup::markFailed(const WaitContext& ctx, const std::string& reason) const {
  if (!failedReason_.empty()) return;
  failedReason_ = reason;
  FailureNote& f = headers_[info_.rank]->failure;
  uint32_t was = f.failed.load(std::memory_order_acquire);
  if ((was & ~kGroupAborted) != 0) return;  // the process announced its failure
  f.seq = ctx.seq;
  const size_t n = std::min(reason.size(), sizeof(f.reason) - 1);
  std::memcpy(f.reason, reason.data(), n);
  f.reason[n] = '\0';
  // A process failure announced meanwhile (a signal handler) wins; the abort flag is kept.
  while ((was & ~kGroupAborted) == 0 &&
         !f.failed.compare_exchange_weak(was, kCollectiveFailed | (was & kGroupAborted), std::memory_order_acq_rel)) {
  }
  // Peers waiting for this rank sleep on its step word: wake them so they look sooner.
  futexWakeAll(&headers_[info_.rank]->step.word);
}

int ShmGroup::acquireHalf(const WaitContext& ctx) {
  checkNotExcluded(ctx);
  noteProgress();
  if (!failedReason_.empty()) {
    throw Error(str("tdx: ", ctx.op, " (sequence ", ctx.seq, ") in group '", info_.name, "' refused on rank ",
                    info_.describeRank(info_.rank), ": an earlier collective failed here, so the ranks' steps no "
                    "longer line up and running another one could corrupt data. Destroy the process group and "
                    "create a new one. The earlier failure: ", failedReason_));
  }
  int h = nextHalf_;
  nextHalf_ ^= 1;
  waitAll(release_[h], ctx);
  return h;
}

std::string ShmGroup::peerAborted(int r) const {
  if (r == info_.rank || (headers_[r]->failure.failed.load(std::memory_order_acquire) & kGroupAborted) == 0) return "";
  return str("rank ", info_.describeRank(r), " (pid ", headers_[r]->pid, ") aborted the group (abort(), "
             "destroy_process_group or shrink_group with SHRINK_ABORT)");
}

void ShmGroup::noteProgress() const {
  const int64_t now = monotonicNs();
  headers_[info_.rank]->progressNs.store(now, std::memory_order_relaxed);
  noteProcessProgress(now);
}

std::string ShmGroup::excludedWhy(int r) const {
  const ExclusionNote& note = headers_[r]->excluded;
  uint32_t state = note.state.load(std::memory_order_acquire);
  if (state == 0) return "";
  // A peer claimed the note and writes a few hundred bytes: give it a moment.
  for (int i = 0; i < 1000 && state == 1; ++i) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    state = note.state.load(std::memory_order_acquire);
  }
  if (state == 1) return str("rank ", info_.describeRank(r), " (pid ", headers_[r]->pid, ") was excluded from the group");
  return std::string(note.reason, strnlen(note.reason, sizeof(note.reason)));
}

void ShmGroup::exclude(int r, const std::string& reason) const {
  ExclusionNote& note = headers_[r]->excluded;
  uint32_t expected = 0;
  if (!note.state.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) return;
  const size_t n = std::min(reason.size(), sizeof(note.reason) - 1);
  std::memcpy(note.reason, reason.data(), n);
  note.reason[n] = '\0';
  note.state.store(2, std::memory_order_release);
  // Its waits (when it runs again) sleep on peers' words for at most 10 ms: they look then.
  futexWakeAll(&headers_[r]->step.word);
  futexWakeAll(&headers_[r]->bell.word);
}

std::string ShmGroup::peerStuck(int r) const {
  if (r == info_.rank) return "";
  const int64_t stuckMs = headers_[r]->stuckMs.load(std::memory_order_acquire);
  if (stuckMs > 0 && headers_[r]->excluded.state.load(std::memory_order_acquire) == 0) {
    const int64_t silentNs = monotonicNs() - headers_[r]->progressNs.load(std::memory_order_relaxed);
    if (silentNs >= stuckMs * 1000000) {
      char secs[64];
      std::snprintf(secs, sizeof(secs), "%.1f s (the stuck time is %.3g s, TDX_FAILURE_DETECTION_S)",
                    static_cast<double>(silentNs) / 1e9, static_cast<double>(stuckMs) / 1e3);
      exclude(r, str("rank ", info_.describeRank(r), " (pid ", headers_[r]->pid, ") was excluded from the group "
                     "after making no progress for ", secs, ": no collective, wait or finished training step in "
                     "that time; it was stopped (SIGSTOP), hung, or busy outside the group's operations that long"));
    }
  }
  return excludedWhy(r);
}

void ShmGroup::checkNotExcluded(const WaitContext& ctx) const {
  if (headers_[info_.rank]->excluded.state.load(std::memory_order_acquire) == 0) return;
  throw ExcludedError(str("tdx: ", ctx.op, " (sequence ", ctx.seq, ") in group '", info_.name, "' refused on rank ",
                          info_.describeRank(info_.rank), ": ", excludedWhy(info_.rank), ". The other ranks go on "
                          "without it; this process can take no further part in the group and must exit (restart "
                          "it to rejoin the job)"));
}

void ShmGroup::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(abortMu_);
    if (abortReason_.empty()) abortReason_ = reason;
  }
  aborted_.store(true);
  // Tell the peers' p2p waits (the flag leaves a collective failure's note as it is).
  headers_[info_.rank]->failure.failed.fetch_or(kGroupAborted, std::memory_order_acq_rel);
  // Wake our own sleepers: they sleep on peers' words, so ring every word we may sleep on.
  for (auto* h : headers_) {
    futexWakeAll(&h->step.word);
    futexWakeAll(&h->bell.word);
  }
}

std::string ShmGroup::abortReason() const {
  std::lock_guard<std::mutex> lock(abortMu_);
  return abortReason_;
}

void ShmGroup::throwWaitFailure(WaitResult res, const std::vector<int>& waitedFor, uint32_t target,
                                const WaitContext& ctx) const {
  std::vector<int> missing;
  for (int r : waitedFor) {
    if (r != info_.rank && !reached(r, target)) missing.push_back(r);
  }
  if (res == WaitResult::kAborted) {
    const std::string reason = abortReason();
    if (!reason.empty()) {  // interrupted: the ranks named in `reason` went silent
      markFailed(ctx, reason);
      throw AbortedError(str("tdx: ", ctx.op, " (sequence ", ctx.seq, ") in group '", info_.name,
                             "' was interrupted while rank ", info_.describeRank(info_.rank), " waited for ranks ",
                             info_.describeRanks(missing), ": ", reason));
    }
    markFailed(ctx, "the process group was aborted");
    throw AbortedError(str("tdx: ", ctx.op, " (sequence ", ctx.seq, ") in group '", info_.name,
                           "' was aborted: the process group was shut down or aborted while rank ",
                           info_.describeRank(info_.rank), " waited for ranks ", info_.describeRanks(missing)));
  }
  if (res == WaitResult::kPeerFailed) {
    checkNotExcluded(ctx);
    std::string why;
    for (int r : missing) {
      std::string d = excludedWhy(r);
      if (d.empty()) d = processGone(r);
      if (d.empty()) d = peerFailure(r);
      if (d.empty()) d = peerRefusal(r, ctx.seq);
      if (!d.empty()) why += (why.empty() ? "" : "; ") + d;
    }
    if (why.empty()) why = "a peer failed";
    std::string msg = str("tdx: ", ctx.op, " (sequence ", ctx.seq, ") in group '", info_.name, "' failed on rank ",
                          info_.describeRank(info_.rank), ": ranks ", info_.describeRanks(missing),
                          " did not arrive because ", why,
                          ". The process group cannot run collectives any more; destroy it and restart the job "
                          "(or the failed ranks)");
    markFailed(ctx, msg);
    throw PeerFailedError(msg);
  }
  std::string msg = str("tdx: ", ctx.op, " (sequence ", ctx.seq, ") in group '", info_.name, "' timed out after ",
                        ctx.timeout.count(), " ms on rank ", info_.describeRank(info_.rank), ": ranks ",
                        info_.describeRanks(missing),
                        " did not arrive. They may have crashed, be stuck, or be running a different collective; "
                        "raise the timeout in init_process_group(timeout=...) if they are only slow");
  markFailed(ctx, msg);
  throw TimeoutError(msg);
}

}  // namespace tdx::shm
