// TdxBackend's shrinking: the survivors of a one-host group form a new backend over a new
// shared-memory group built through the parent's segments (transport/shm/shrink.h), so no store
// is needed (the store's host may be the rank that died).
#include <c10/util/Exception.h>

#include <algorithm>

#include "backend/host_engine.h"
#include "backend/tdx_backend.h"
#include "backend/work.h"
#include "common/logging.h"
#include "transport/shm/shrink.h"

namespace tdx {

namespace {

constexpr int kShrinkAbort = 1;  // torch.distributed.distributed_c10d.SHRINK_ABORT

}  // namespace

TdxBackend::TdxBackend(Shrunk, int rank, int size, std::chrono::milliseconds timeout, GroupInfo info,
                       std::unique_ptr<Routes> routes)
    : c10d::Backend(rank, size), timeout_(timeout), info_(std::move(info)), routes_(std::move(routes)) {}

bool TdxBackend::supportsShrinking() const {
  return dynamic_cast<ShmEngine*>(&routes_->host()) != nullptr;
}

std::vector<std::pair<int64_t, std::string>> TdxBackend::goneRanks() const {
  auto* shm = dynamic_cast<ShmEngine*>(&routes_->host());
  TORCH_CHECK(shm != nullptr, "tdx: gone_ranks: group '", info_.name, "' spans hosts; only one-host groups say "
              "which ranks are gone");
  std::vector<std::pair<int64_t, std::string>> gone;
  for (int r = 0; r < size_; ++r) {
    std::string why = shm->group().processGone(r);
    if (!why.empty()) gone.emplace_back(r, std::move(why));
  }
  return gone;
}

c10::intrusive_ptr<c10d::Backend> TdxBackend::shrink(const std::vector<int64_t>& ranksToExclude, int shrinkFlags,
                                                     const c10::intrusive_ptr<Options>& optsOverride) {
  auto* shm = dynamic_cast<ShmEngine*>(&routes_->host());
  TORCH_CHECK(shm != nullptr, "tdx: shrink: group '", info_.name, "' spans hosts; tdx shrinks one-host groups "
              "only. Create a new process group over the surviving ranks instead");
  TORCH_CHECK(routes_->device() == nullptr, "tdx: shrink: group '", info_.name, "' moved CUDA tensors through "
              "NCCL, which tdx does not shrink; create a new process group over the surviving ranks instead");
  TORCH_CHECK_VALUE((shrinkFlags & ~kShrinkAbort) == 0, "tdx: shrink: unknown shrink_flags ", shrinkFlags,
                    "; use SHRINK_DEFAULT (0) or SHRINK_ABORT (1)");
  std::vector<int> exclude;
  for (int64_t r : ranksToExclude) {
    TORCH_CHECK_VALUE(r >= 0 && r < size_, "tdx: shrink: rank ", r, " to exclude is out of range for a group of "
                      "size ", size_);
    TORCH_CHECK_VALUE(r != rank_, "tdx: shrink: rank ", r, " excludes itself; only the surviving ranks call shrink");
    TORCH_CHECK_VALUE(std::find(exclude.begin(), exclude.end(), r) == exclude.end(), "tdx: shrink: rank ", r,
                      " is listed twice in ranks_to_exclude");
    exclude.push_back(static_cast<int>(r));
  }
  TORCH_CHECK_VALUE(!exclude.empty(), "tdx: shrink: ranks_to_exclude is empty; name at least one rank");
  // SHRINK_ABORT: interrupt what waits here (a collective blocked on the dead rank) before the
  // survivors meet; the parent group then refuses further collectives.
  if (shrinkFlags & kShrinkAbort) shm->abort();
  const auto timeout = optsOverride ? optsOverride->timeout : timeout_;
  const WaitContext ctx = waitFromNow("shrink", 0, timeout);
  GroupInfo info = info_;
  info.name = str(info_.name, ":shrunk");
  std::unique_ptr<shm::ShmGroup> group;
  try {
    group = shm::shrinkGroup(shm->group(), exclude, info, ctx);
  } catch (const Error&) {
    std::rethrow_exception(toTorchError(std::current_exception()));
  }
  info = group->info();
  std::vector<std::string> nodeIds;
  for (int r = 0; r < size_; ++r) {
    if (std::find(exclude.begin(), exclude.end(), r) == exclude.end()) nodeIds.push_back(routes_->nodeIds()[r]);
  }
  const int rank = info.rank, size = info.size;
  auto engine = std::make_unique<ShmEngine>(std::move(group), rank);
  auto routes = std::make_unique<Routes>(std::move(engine), routes_->store(), info, std::move(nodeIds));
  return c10::make_intrusive<TdxBackend>(Shrunk{}, rank, size, timeout, std::move(info), std::move(routes));
}

}  // namespace tdx
