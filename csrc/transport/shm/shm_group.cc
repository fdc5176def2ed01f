#include "transport/shm/shm_group.h"

#include <unistd.h>

#include <cstring>
#include <new>

#include "common/logging.h"

namespace tdx::shm {

namespace {

constexpr uint64_t kMagic = 0x7464785f73686d31ull;  // "tdx_shm1"
constexpr size_t kPage = 4096;

size_t roundUp(size_t v, size_t a) { return (v + a - 1) / a * a; }

struct Layout {
  size_t ringCtlOff, halvesOff, ringsOff, total;
};

Layout layoutFor(int size, const ShmOptions& o) {
  Layout l;
  l.ringCtlOff = roundUp(sizeof(RankHeader), kPage);
  l.halvesOff = roundUp(l.ringCtlOff + sizeof(RingCtl) * static_cast<size_t>(size), kPage);
  l.ringsOff = l.halvesOff + 2 * roundUp(o.halfBytes, kPage);
  l.total = l.ringsOff + static_cast<size_t>(size) * roundUp(o.ringBytes, kPage);
  return l;
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
  for (int d = 0; d < n; ++d) {
    new (segments_[info.rank].data() + layout.ringCtlOff + d * sizeof(RingCtl)) RingCtl();
  }

  rdv.set(str("tdx/seg/", info.rank), segments_[info.rank].name());
  for (int r = 0; r < n; ++r) {
    if (r == info.rank) continue;
    segments_[r] = Segment::open(rdv.get(str("tdx/seg/", r)), segBytes_);
  }
  rdv.set(str("tdx/mapped/", info.rank), "1");
  for (int r = 0; r < n; ++r) {
    if (r != info.rank) rdv.get(str("tdx/mapped/", r));
  }
  // Every rank has mapped our segment: the name is no longer needed.
  segments_[info.rank].unlink();

  for (int r = 0; r < n; ++r) {
    char* base = segments_[r].data();
    auto* h = reinterpret_cast<RankHeader*>(base);
    TDX_ENFORCE(h->magic == kMagic && h->rank == r && h->size == n, "peer segment of rank ", r,
                " is not a tdx segment of this group (magic/rank/size mismatch)");
    headers_.push_back(h);
    ringCtls_.push_back(reinterpret_cast<RingCtl*>(base + layout.ringCtlOff));
    halves_.push_back(base + layout.halvesOff);
    rings_.push_back(base + layout.ringsOff);
  }
}

ShmGroup::~ShmGroup() = default;

uint32_t ShmGroup::post() {
  Doorbell& d = headers_[info_.rank]->step;
  ++posted_;
  d.word.store(posted_, std::memory_order_seq_cst);
  wakeSleepers(d);
  return posted_;
}

void ShmGroup::waitRank(int r, uint32_t target, const WaitContext& ctx) {
  WaitResult res = waitUntil([&] { return reached(r, target); }, headers_[r]->step, ctx.deadline, &aborted_,
                             opts_.wait);
  if (res != WaitResult::kReady) throwWaitFailure(res, {r}, target, ctx);
}

void ShmGroup::waitAll(uint32_t target, const WaitContext& ctx) {
  for (int r = 0; r < info_.size; ++r) {
    if (r == info_.rank) continue;
    WaitResult res = waitUntil([&] { return reached(r, target); }, headers_[r]->step, ctx.deadline, &aborted_,
                               opts_.wait);
    if (res != WaitResult::kReady) {
      std::vector<int> all(info_.size);
      for (int i = 0; i < info_.size; ++i) all[i] = i;
      throwWaitFailure(res, all, target, ctx);
    }
  }
}

int ShmGroup::acquireHalf(const WaitContext& ctx) {
  int h = nextHalf_;
  nextHalf_ ^= 1;
  waitAll(release_[h], ctx);
  return h;
}

void ShmGroup::abort() {
  aborted_.store(true);
  // Wake our own sleepers: they sleep on peers' words, so ring every word we may sleep on.
  for (auto* h : headers_) {
    futexWakeAll(&h->step.word);
    futexWakeAll(&h->bell.word);
  }
}

void ShmGroup::throwWaitFailure(WaitResult res, const std::vector<int>& waitedFor, uint32_t target,
                                const WaitContext& ctx) const {
  std::vector<int> missing;
  for (int r : waitedFor) {
    if (r != info_.rank && !reached(r, target)) missing.push_back(r);
  }
  if (res == WaitResult::kAborted) {
    throw AbortedError(str("tdx: ", ctx.op, " (sequence ", ctx.seq, ") in group '", info_.name,
                           "' was aborted: the process group was shut down or aborted while rank ",
                           info_.describeRank(info_.rank), " waited for ranks ", info_.describeRanks(missing)));
  }
  throw TimeoutError(str("tdx: ", ctx.op, " (sequence ", ctx.seq, ") in group '", info_.name, "' timed out after ",
                         ctx.timeout.count(), " ms on rank ", info_.describeRank(info_.rank), ": ranks ",
                         info_.describeRanks(missing),
                         " did not arrive. They may have crashed, be stuck, or be running a different collective; "
                         "raise the timeout in init_process_group(timeout=...) if they are only slow"));
}

}  // namespace tdx::shm
