// The link of a group spanning hosts: torch's Gloo groups between the hosts, this host's
// shared-memory group, and how a rank waits on them. A wait on Gloo ends as soon as a host mate
// failed (gloo_wait.h); a failure names the operation, the hosts and ranks it waited for and, when a
// rank of another host left a note, the cause (failure_notes.h); a failure in a shared-memory step
// is left in the store for the other hosts, whose ranks only see their Gloo connections close.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "multihost/failure_notes.h"
#include "multihost/layout.h"
#include "transport/shm/shm_group.h"
#include "transport/transport.h"

namespace tdx {

using GlooWork = c10::intrusive_ptr<c10d::Work>;

// The Gloo groups of a group spanning hosts (torchdist_ext/_backend.py builds them, for a new
// group and for a shrink alike).
struct GlooGroups {
  c10::intrusive_ptr<c10d::Backend> all;    // every rank of the group
  c10::intrusive_ptr<c10d::Backend> slice;  // the ranks with this rank's local index, by host (uniform layouts), else null
};

class Link {
 public:
  // `local`: this host's ranks (outlives the Link). `store` (the group's) carries failure notes
  // between hosts. nodeIds[r] is the host of group rank r; globalRanks maps group ranks to global
  // ranks (empty: the same), for errors.
  Link(HostLayout layout, int rank, int size, shm::ShmGroup& local, GlooGroups gloo,
       c10::intrusive_ptr<c10d::Store> store, std::vector<std::string> nodeIds, std::vector<int64_t> globalRanks);

  const HostLayout& layout() const { return layout_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  shm::ShmGroup& local() const { return local_; }
  c10d::Backend& all() const { return *gloo_.all; }
  // The slice group: only where every host has as many ranks (sliced()).
  bool sliced() const { return gloo_.slice != nullptr; }
  // The Gloo groups, to keep alive with an operation given up on (gloo_wait.h).
  std::vector<c10::intrusive_ptr<c10d::Backend>> glooGroups() const { return {gloo_.all, gloo_.slice}; }
  c10d::Backend& slice() const { return *gloo_.slice; }

  // Waits for a Gloo operation (or several Gloo p2p Works, in order). `check` runs once per watch
  // period while Gloo works; its error (a mismatch) is rethrown as is.
  void wait(const GlooWork& work, const WaitContext& ctx, const std::function<void()>& check = nullptr);
  void wait(const std::vector<GlooWork>& works, const WaitContext& ctx, const std::function<void()>& check = nullptr);
  // Throws the failure `e` of a Gloo operation (posting it or waiting for it) as wait() does; this
  // host's ranks waiting for this one in shared memory fail at once, quoting the cause.
  [[noreturn]] void fail(const std::exception& e, const WaitContext& ctx);
  // Runs `post`, which posts Gloo p2p into `works`. Posting to a closed connection throws at once:
  // the Works already posted are kept for the process's life (Gloo may still use their tensors) and
  // the failure is thrown as wait() throws it.
  void post(std::vector<GlooWork>& works, const std::function<void()>& post, const WaitContext& ctx);
  // Runs a shared-memory step; a failure there is also left in the store for the other hosts.
  void runLocal(const std::function<void()>& fn);
  // The node ids of the hosts the last cross-host failure named as failed or silent (empty before one).
  std::vector<std::string> failedHosts() const;

  // A scratch tensor of `numel` elements of `dtype`, kept for the next call in `slot` (0 or 1) when
  // it is at most 256 MiB: the group's operations run one at a time, and a fresh allocation of tens
  // of MB costs more in page faults than the memory pass it serves.
  at::Tensor scratch(int slot, int64_t numel, at::ScalarType dtype);

 private:
  HostLayout layout_;
  int rank_;
  int size_;
  shm::ShmGroup& local_;
  GlooGroups gloo_;
  CrossHostFailures failures_;
  mutable std::mutex failedMu_;
  std::vector<std::string> failedHosts_;  // see failedHosts(), under failedMu_
  at::Tensor scratch_[2];  // bytes, see scratch()
};

}  // namespace tdx
