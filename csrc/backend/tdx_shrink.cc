// TdxBackend's shrinking: the survivors of each host form a new shared-memory group through the
// parent's segments (transport/shm/shrink.h), without the store (its host may be the rank that
// died). A group spanning hosts also re-forms its cross-host part: new Gloo groups among the
// survivors, which Python builds (torchdist_ext/_backend.py) through the group's store under a
// prefix no earlier group used (shrinkMeeting), before shrinkWith.
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <c10/util/Exception.h>

#include <algorithm>

#include "backend/host_engine.h"
#include "backend/tdx_backend.h"
#include "backend/work.h"
#include "common/logging.h"
#include "multihost/failure_notes.h"
#include "transport/shm/shrink.h"

namespace tdx {

namespace {

constexpr int kShrinkAbort = 1;  // torch.distributed.distributed_c10d.SHRINK_ABORT

std::unique_ptr<shm::ShmGroup> shrinkShm(shm::ShmGroup& parent, const std::vector<int>& exclude, GroupInfo info,
                                         const WaitContext& ctx) {
  try {
    return shm::shrinkGroup(parent, exclude, std::move(info), ctx);
  } catch (const Error&) {
    std::rethrow_exception(toTorchError(std::current_exception()));
  }
}

template <class T>
std::vector<T> without(const std::vector<T>& all, const std::vector<int>& exclude) {
  std::vector<T> kept;
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    if (std::find(exclude.begin(), exclude.end(), r) == exclude.end()) kept.push_back(all[r]);
  }
  return kept;
}

}  // namespace

TdxBackend::TdxBackend(Shrunk, int rank, int size, std::chrono::milliseconds timeout, GroupInfo info,
                       std::unique_ptr<Routes> routes)
    : c10d::Backend(rank, size), timeout_(timeout), info_(std::move(info)), routes_(std::move(routes)) {
  if (trace::enabled()) recorder_ = std::make_unique<trace::GroupRecorder>(rank, size, info_.globalRanks);
  groupsChanged();
}

// Every group's CPU tensors go through a host engine, which shrinks (shrink() refuses a group whose
// CUDA tensors went through NCCL, saying why).
bool TdxBackend::supportsShrinking() const { return true; }

void TdxBackend::interrupt(const std::string& reason) {
  TORCH_CHECK_VALUE(!reason.empty(), "tdx: interrupt: give the reason (which ranks went silent and why)");
  routes_->host().interrupt(reason);
}

std::vector<std::string> TdxBackend::failedHosts() const { return routes_->host().failedHosts(); }

std::vector<std::pair<int64_t, std::string>> TdxBackend::goneRanks(std::chrono::milliseconds noteWait) const {
  HostEngine& host = routes_->host();
  const HostLayout layout = computeHostLayout(routes_->nodeIds(), rank_);
  std::vector<std::pair<int64_t, std::string>> gone;
  for (int i = 0; i < layout.localSize; ++i) {
    std::string why = host.group().processGone(i);
    if (why.empty()) why = host.group().peerStuck(i);
    if (why.empty()) continue;
    const int r = layout.localRanks[i];
    // The host's group names its ranks by local index: name the group rank instead.
    const std::string local = str("rank ", host.group().info().describeRank(i), " ");
    if (layout.numHosts > 1 && why.rfind(local, 0) == 0) {
      why = str("rank ", info_.describeRank(r), " ", why.substr(local.size()));
    }
    // The other hosts' ranks only see Gloo connections close: tell them which rank it was.
    if (layout.numHosts > 1) postGone(routes_->store(), r, why, failureWaits().post);
    gone.emplace_back(r, std::move(why));
  }
  if (layout.numHosts == 1) return gone;
  // A rank of another host is gone when its host mates said so (their own gone_ranks, which runs
  // when their collective fails; give them a moment when nothing is known here).
  for (auto& [r, why] : readGone(routes_->store(), size_, gone.empty() ? noteWait : std::chrono::milliseconds(0))) {
    if (routes_->nodeIds()[r] != routes_->nodeIds()[rank_]) gone.emplace_back(r, str(why, " (on host '",
                                                                                     routes_->nodeIds()[r], "')"));
  }
  std::sort(gone.begin(), gone.end());
  return gone;
}

void TdxBackend::setStuckTimeout(double seconds) {
  TORCH_CHECK_VALUE(seconds >= 0, "tdx: the stuck time must be >= 0 seconds (0 turns the watch off), got ", seconds);
  shm::ShmGroup& g = routes_->host().group();
  g.noteProgress();  // silent until now is not stuck: the watch starts here
  g.setStuckTimeout(std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
}

std::string TdxBackend::excluded() const {
  shm::ShmGroup& g = routes_->host().group();
  return g.excludedWhy(g.rank());
}

TdxBackend::ShrinkMeeting TdxBackend::shrinkMeeting(const std::vector<int64_t>& ranksToExclude, int shrinkFlags,
                                                    const c10::intrusive_ptr<Options>& optsOverride) {
  TORCH_CHECK(routes_->device() == nullptr, "tdx: shrink: group '", info_.name, "' moved CUDA tensors through "
              "NCCL, which tdx does not shrink; create a new process group over the surviving ranks instead");
  TORCH_CHECK_VALUE((shrinkFlags & ~kShrinkAbort) == 0, "tdx: shrink: unknown shrink_flags ", shrinkFlags,
                    "; use SHRINK_DEFAULT (0) or SHRINK_ABORT (1)");
  ShrinkMeeting m;
  for (int64_t r : ranksToExclude) {
    TORCH_CHECK_VALUE(r >= 0 && r < size_, "tdx: shrink: rank ", r, " to exclude is out of range for a group of "
                      "size ", size_);
    TORCH_CHECK_VALUE(r != rank_, "tdx: shrink: rank ", r, " excludes itself; only the surviving ranks call shrink");
    TORCH_CHECK_VALUE(std::find(m.exclude.begin(), m.exclude.end(), r) == m.exclude.end(), "tdx: shrink: rank ", r,
                      " is listed twice in ranks_to_exclude");
    m.exclude.push_back(static_cast<int>(r));
  }
  TORCH_CHECK_VALUE(!m.exclude.empty(), "tdx: shrink: ranks_to_exclude is empty; name at least one rank");
  std::sort(m.exclude.begin(), m.exclude.end());
  const uint32_t attempt = ++shrinks_;  // every survivor counts its calls alike, failed ones too
  m.timeout = optsOverride ? optsOverride->timeout : timeout_;
  m.nodeIds = without(routes_->nodeIds(), m.exclude);
  m.size = size_ - static_cast<int>(m.exclude.size());
  m.rank = rank_ - static_cast<int>(std::count_if(m.exclude.begin(), m.exclude.end(), [&](int r) { return r < rank_; }));
  // A store prefix naming this shrink (every survivor derives the same one; the parent's keys and a
  // dead rank's are never read).
  std::string prefix = str("tdx/shrink", attempt, "/x");
  for (int r : m.exclude) prefix += str(r, ".");
  m.store = c10::make_intrusive<c10d::PrefixStore>(prefix + "/", routes_->store());
  return m;
}

c10::intrusive_ptr<c10d::Backend> TdxBackend::shrink(const std::vector<int64_t>& ranksToExclude, int shrinkFlags,
                                                     const c10::intrusive_ptr<Options>& optsOverride) {
  return shrinkWith(shrinkMeeting(ranksToExclude, shrinkFlags, optsOverride), shrinkFlags, nullptr, nullptr);
}

c10::intrusive_ptr<c10d::Backend> TdxBackend::shrinkWith(const ShrinkMeeting& m, int shrinkFlags,
                                                         c10::intrusive_ptr<c10d::Backend> glooAll,
                                                         c10::intrusive_ptr<c10d::Backend> glooSlice) {
  HostEngine& host = routes_->host();
  const HostLayout before = computeHostLayout(routes_->nodeIds(), rank_);
  const HostLayout after = computeHostLayout(m.nodeIds, m.rank);
  TORCH_CHECK(after.numHosts == 1 || glooAll, "tdx: shrink: the survivors of group '", info_.name, "' span ",
              after.numHosts, " hosts and need new Gloo groups, which torchdist_ext builds in Python; shrink "
              "through torch.distributed.shrink_group after `import torchdist_ext`");
  // SHRINK_ABORT: interrupt what waits here (a collective blocked on the dead rank) before the
  // survivors meet; the parent group then refuses further collectives.
  if (shrinkFlags & kShrinkAbort) host.abort();
  const WaitContext ctx = waitFromNow("shrink", 0, m.timeout);
  GroupInfo info = info_;
  info.name = str(info_.name, ":shrunk");
  info.globalRanks = without(info_.globalRanks, m.exclude);
  info.size = m.size;
  info.rank = m.rank;
  std::vector<std::string> nodeIds = m.nodeIds;
  // This host's part: its survivors (every local rank that is not excluded) shrink its group.
  std::vector<int> localExclude;
  for (int i = 0; i < before.localSize; ++i) {
    if (std::binary_search(m.exclude.begin(), m.exclude.end(), before.localRanks[i])) localExclude.push_back(i);
  }
  if (after.numHosts == 1) {  // only this host's ranks survive: a one-host group
    auto group = shrinkShm(host.group(), localExclude, info, ctx);
    auto engine = std::make_unique<ShmEngine>(std::move(group), info.rank);
    auto routes = std::make_unique<Routes>(std::move(engine), routes_->store(), info, std::move(nodeIds));
    return c10::make_intrusive<TdxBackend>(Shrunk{}, info.rank, info.size, m.timeout, std::move(info),
                                           std::move(routes));
  }
  GroupInfo local = info;
  local.name = str(info.name, "/host", after.hostIndex);
  auto group = shrinkShm(host.group(), localExclude, local, ctx);
  auto engine = std::make_unique<HierarchicalEngine>(
      std::move(group), CrossHost{after, GlooGroups{glooAll, glooSlice}, m.store, nodeIds, info.globalRanks},
      info.rank, info.size);
  auto routes = std::make_unique<Routes>(std::move(engine), m.store, info, std::move(nodeIds));
  return c10::make_intrusive<TdxBackend>(Shrunk{}, info.rank, info.size, m.timeout, std::move(info),
                                         std::move(routes));
}

}  // namespace tdx
