#include "multihost/mismatch_check.h"

#include <string>

#include "common/logging.h"

namespace tdx {

Agreement MismatchCheck::begin(const shm::OpDesc& mine, const WaitContext& ctx, bool checkBytes) {
  Agreement a;
  a.desc = mine;
  a.checkBytes = checkBytes;
  shm::OpDesc d = mine;
  d.history = history_;
  history_ = nextHistory(history_, d);
  shm::ShmGroup& local = link_.local();
  if (!fullChecks_) {
    // Cheap: this host's ranks compare (in confirm). A mismatch with another host surfaces there at
    // the group timeout, in the Gloo part, naming this operation and sequence number.
    if (local.size() > 1) link_.runLocal([&] { a.pending = tdx::beginAgree(local, mine, ctx); });
    return a;
  }
  // Full: every rank of the group compares every rank's descriptor (not the host's check first:
  // a host that raised alone would leave the other hosts waiting in this all_gather).
  constexpr int kFields = 7;
  const int size = link_.size(), rank = link_.rank();
  at::Tensor row = at::tensor({static_cast<int64_t>(d.seq), static_cast<int64_t>(d.op),
                               static_cast<int64_t>(d.dtype), static_cast<int64_t>(d.bytes),
                               static_cast<int64_t>(d.root), static_cast<int64_t>(d.redop),
                               static_cast<int64_t>(d.history)},
                              at::kLong);
  at::Tensor all = at::empty({size * kFields}, at::kLong);
  link_.wait(link_.all()._allgather_base(all, row), ctx);
  const int64_t* rows = all.data_ptr<int64_t>();
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    const int64_t* f = rows + r * kFields;
    shm::OpDesc t{};
    t.seq = static_cast<uint64_t>(f[0]);
    t.op = static_cast<uint32_t>(f[1]);
    t.dtype = static_cast<uint32_t>(f[2]);
    t.bytes = static_cast<uint64_t>(f[3]);
    t.root = static_cast<int32_t>(f[4]);
    t.redop = static_cast<int32_t>(f[5]);
    t.history = static_cast<uint64_t>(f[6]);
    const bool same = t.seq == d.seq && t.op == d.op && t.dtype == d.dtype && (!checkBytes || t.bytes == d.bytes) &&
                      t.root == d.root && t.redop == d.redop;
    if (same && t.history == d.history) continue;
    std::string msg = same ? historyMismatch(local.info().name, std::to_string(rank), d, shm::OpDesc{},
                                             std::to_string(r), shm::OpDesc{})
                           : str("tdx: mismatched collectives across hosts: rank ", rank, " expects ",
                                 describeDesc(d), " but rank ", r, " called ", describeDesc(t),
                                 ". Every rank must call the same collectives in the same order with the same "
                                 "dtype, size, root and reduce op");
    throw Error(msg);
  }
  return a;
}

void MismatchCheck::confirm(Agreement& a, const WaitContext& ctx) {
  if (a.pending.half < 0) return;
  const PendingAgree p = a.pending;
  a.pending = PendingAgree{};
  link_.runLocal([&] { tdx::finishAgree(link_.local(), p, a.desc, ctx, a.checkBytes); });
}

void MismatchCheck::agree(const shm::OpDesc& mine, const WaitContext& ctx, bool checkBytes) {
  Agreement a = begin(mine, ctx, checkBytes);
  confirm(a, ctx);
}

void MismatchCheck::runFirstLocal(Agreement& a, const std::function<void()>& fn, const WaitContext& ctx) {
  link_.runLocal([&] {
    try {
      fn();
    } catch (const Error&) {
      // The step's own check names the step (a reduce_scatter inside an all_reduce, say); the
      // host mates that published this operation's descriptor tell what the caller mismatched.
      if (a.pending.half >= 0) recheckAgree(link_.local(), a.pending, a.desc, a.checkBytes);
      throw;
    }
  });
  confirm(a, ctx);
}

}  // namespace tdx
