// The mismatch check of every cross-host operation: do all ranks run the same collective (op,
// dtype, size, root, reduce op, and the same history of earlier calls)?
//
// Cheap checks (the default): the ranks of this host compare descriptors over shared memory;
// begin() publishes this rank's without waiting and confirm() waits for the host mates' and
// compares. An operation whose first step is a shared-memory one (the sliced all_reduce, reduce and
// reduce_scatter) confirms right after it (runFirstLocal): that step waits for the host mates
// anyway, so the check costs no synchronization of its own. Every other operation confirms before
// it starts anything across hosts: a Gloo operation that mismatched ranks started could not be
// cancelled, and it would hold the Gloo group (and the group's destruction) until Gloo's own
// timeout. The flat broadcast is the exception (its latency is the host mates' skew): it compares
// while Gloo runs, and a mismatch found then keeps the Gloo groups alive for the process's life
// instead of waiting for Gloo. Under full checks (TDX_DEBUG, on everywhere as soon as one rank asks)
// every rank of the group compares every rank's descriptor through one Gloo all_gather in begin()
// (confirm() does nothing), so a mismatch across hosts raises in the operation itself on every rank.
#pragma once

#include <functional>

#include "collectives/op_desc.h"
#include "multihost/link.h"

namespace tdx {

// One operation's check between begin() and confirm().
struct Agreement {
  shm::OpDesc desc{};
  PendingAgree pending;  // half -1: nothing left to confirm
  bool checkBytes = true;
};

class MismatchCheck {
 public:
  MismatchCheck(Link& link, bool fullChecks) : link_(link), fullChecks_(fullChecks) {}

  bool full() const { return fullChecks_; }
  Agreement begin(const shm::OpDesc& mine, const WaitContext& ctx, bool checkBytes = true);
  void confirm(Agreement& a, const WaitContext& ctx);  // a second call does nothing
  // Both at once, for the operations that start across hosts.
  void agree(const shm::OpDesc& mine, const WaitContext& ctx, bool checkBytes = true);
  // The first shared-memory step of an operation between begin() and confirm(), then confirm(); a
  // mismatch the step catches is reported as the operation's (not the step's).
  void runFirstLocal(Agreement& a, const std::function<void()>& fn, const WaitContext& ctx);

 private:
  Link& link_;
  bool fullChecks_;
  uint64_t history_ = 0;  // over the descriptors passed to begin(), the same on every host
};

}  // namespace tdx
