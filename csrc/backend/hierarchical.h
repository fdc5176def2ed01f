// The multi-host (hierarchical) mode of the tdx backend: shared memory inside each host, torch's
// Gloo between hosts. Only built when a group's ranks report more than one node id.
//
// all_reduce (and reduce / reduce_scatter, which are built on it): the ranks of a host
// reduce-scatter over shared memory so local rank j holds slice j of the host's partial result;
// slice j is all-reduced across hosts over a Gloo group made of the ranks with local index j on
// every host (so every local rank carries its own slice at once); a shared-memory all-gather then
// gives every rank the whole result. Between two hosts, operations below 1 MiB swap the slice
// partials instead (one Gloo all_gather, summed in host order). Gloo returns the same bits on every
// participant, so results are bit-identical on every rank. Hosts with unequal rank counts fall back to one Gloo
// all_reduce over the whole group (correct, slower).
//
// Route per call (TDX_XHOST_ALGO, hierarchical_route.cc): "sliced" runs the algorithms above,
// "flat" one Gloo operation over all ranks (Gloo's own algorithm); "auto" picks per operation
// from its bytes and the host link rate measured once when the group is made.
//
// Every other operation runs through a Gloo group spanning all ranks of the group, on byte views
// of the tensors (so every dtype moves, including those Gloo cannot reduce), and so does all p2p
// (so receiving from any source works across hosts). A flat broadcast up to 512 KiB is Gloo p2p
// from the root to every rank on the calling threads (tag 0x7ffffffe, refused to user p2p), not
// Gloo's broadcast, whose hand-off to Gloo's worker thread and back cost more on busy cores.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "backend/cross_host_failure.h"
#include "collectives/op_desc.h"
#include "collectives/types.h"
#include "transport/shm/shm_group.h"

namespace tdx {

// Where this rank sits among the hosts of its group.
struct HostLayout {
  int numHosts = 1;
  int hostIndex = 0;             // hosts are numbered in the order of their lowest group rank
  int localRank = 0;
  int localSize = 1;
  std::vector<int> localRanks;   // group ranks on this host, ascending
  std::vector<std::vector<int>> hostRanks;  // group ranks of each host, by host index
  bool uniform = true;           // every host has localSize ranks
};

// Groups ranks by node id (`nodeIds[r]` for group rank r).
HostLayout computeHostLayout(const std::vector<std::string>& nodeIds, int rank);

class Hierarchy {
 public:
  // `all` spans every rank of the group; `slice` (uniform layouts only) holds the ranks with this
  // rank's local index on every host, ordered by host index.
  // `store` (the group's) carries failure notes between hosts; may be null. nodeIds[r] is the host
  // of group rank r, globalRanks maps group ranks to global ranks (empty: the same), for errors.
  Hierarchy(HostLayout layout, int rank, int size, c10::intrusive_ptr<c10d::Backend> all,
            c10::intrusive_ptr<c10d::Backend> slice, c10::intrusive_ptr<c10d::Store> store,
            std::vector<std::string> nodeIds, std::vector<int64_t> globalRanks);

  const HostLayout& layout() const { return layout_; }

  // Gives the host's shared-memory group (for the per-operation checks) and agrees across hosts
  // on full mismatch checks (on everywhere as soon as one rank asks). Collective over the group.
  void attachLocal(shm::ShmGroup* local);

  // Mismatch checks of every operation. Cheap checks (the default): the ranks of this host compare
  // descriptors over shared memory; beginAgree publishes this rank's without waiting and
  // confirmAgree waits for the host mates' and compares. An operation whose first step is a
  // shared-memory one (the sliced all_reduce, reduce and reduce_scatter) confirms right after it:
  // that step waits for the host mates anyway, so the check costs no synchronization of its own.
  // Every other operation confirms before it starts anything across hosts: a Gloo operation that
  // mismatched ranks started could not be cancelled, and it would hold the Gloo group (and the
  // group's destruction) until Gloo's own timeout. The flat broadcast is the exception (its latency
  // is the host mates' skew): it compares while Gloo runs, and a mismatch found then keeps the Gloo
  // groups alive for the process's life instead of waiting for Gloo. Under full checks every rank of the group
  // compares every rank's descriptor through one Gloo all_gather in beginAgree (confirmAgree does
  // nothing), so a mismatch across hosts raises in the operation itself on every rank.
  struct Agreement {
    shm::OpDesc desc{};
    PendingAgree pending;  // half -1: nothing left to confirm
    bool checkBytes = true;
  };
  Agreement beginAgree(const shm::OpDesc& mine, const WaitContext& ctx, bool checkBytes = true);
  void confirmAgree(Agreement& a, const WaitContext& ctx);  // a second call does nothing
  // Both at once, for the operations that start across hosts.
  void agree(const shm::OpDesc& mine, const WaitContext& ctx, bool checkBytes = true);

  // In place on contiguous tensors of one real (or bool) dtype, reduced as one logical array.
  // `root` >= 0: a reduce to that rank (checked as one; the ranks whose tensors the route writes
  // get the result too). `keepInputs`: `tensors` are left as they were (a non-root of a reduce;
  // copied first where the route would write them).
  void allreduce(shm::ShmGroup& local, const std::vector<at::Tensor>& tensors, ReduceOp op,
                 const WaitContext& ctx, int root = -1, bool keepInputs = false);
  // reduce_scatter: `output` gets block `rank` of the reduction of `blocks` (world-size contiguous
  // 1-D tensors of output.numel() elements, read only). `whole`, when defined, is one contiguous
  // tensor holding the blocks back to back (saves a concatenation where Gloo needs one).
  void reduceScatter(shm::ShmGroup& local, const at::Tensor& output, const std::vector<at::Tensor>& blocks,
                     const at::Tensor& whole, ReduceOp op, const WaitContext& ctx);

  // Data movement through the all-ranks Gloo group (tensors may be non-contiguous).
  void broadcast(const std::vector<at::Tensor>& tensors, int root, const WaitContext& ctx);
  void allgather(const std::vector<at::Tensor>& outputs, const at::Tensor& input, const WaitContext& ctx);
  void gather(const std::vector<at::Tensor>& outputs, const at::Tensor& input, int root, const WaitContext& ctx);
  void scatter(const at::Tensor& output, const std::vector<at::Tensor>& inputs, int root, const WaitContext& ctx);
  // Byte splits per peer of the (contiguous-staged) input and output.
  void alltoallBytes(const at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& outBytes,
                     const std::vector<int64_t>& inBytes, const WaitContext& ctx);
  void alltoall(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                const WaitContext& ctx);
  void barrier(const WaitContext& ctx);

  // Asynchronous p2p through Gloo; the Work writes non-contiguous receives back on wait().
  c10::intrusive_ptr<c10d::Work> send(const at::Tensor& tensor, int dst, int tag);
  c10::intrusive_ptr<c10d::Work> recv(const at::Tensor& tensor, int src, int tag);  // src -1: any

 private:
  // Waits for a Gloo operation; a failure names the tdx operation, its sequence number, the hosts
  // and ranks it waited for and, when a rank of another host reported one (e.g. "rank 3 (pid 42)
  // exited"), the cause.
  // `check` runs once per watch period while Gloo works; its error (a mismatch) is rethrown as is.
  void waitGloo(const c10::intrusive_ptr<c10d::Work>& work, const WaitContext& ctx,
                const std::function<void()>& check = nullptr);
  // Several Gloo p2p Works (no future), waited for in order.
  void waitGloo(const std::vector<c10::intrusive_ptr<c10d::Work>>& works, const WaitContext& ctx,
                const std::function<void()>& check = nullptr);
  // Throws the failure `e` of a Gloo operation (posting it or waiting for it) as waitGloo does.
  [[noreturn]] void failGloo(const std::exception& e, const WaitContext& ctx);
  // Runs `post`, which posts Gloo p2p into `works`. Posting to a closed connection throws at once:
  // the Works already posted are kept for the process's life (Gloo may still use their tensors) and
  // the failure is thrown as waitGloo throws it.
  void postGloo(std::vector<c10::intrusive_ptr<c10d::Work>>& works, const std::function<void()>& post,
                const WaitContext& ctx);
  // Runs a shared-memory step; a failure there is also left in the store for the other hosts.
  void runLocal(const std::function<void()>& fn);
  // The first shared-memory step of an operation between beginAgree and confirmAgree, then
  // confirmAgree; a mismatch the step catches is reported as the operation's (not the step's).
  void runFirstLocal(Agreement& a, const std::function<void()>& fn, const WaitContext& ctx);
  // A Gloo all_reduce in flight: launched by startGlooAllreduce, completed (widened dtypes copied
  // back, AVG divided) by finishGlooAllreduce.
  // Under TDX_XHOST_COMPRESS=int8 (slice groups only) `sent` is this host's int8 packet and
  // `packets` the packets of every host (a Gloo all_gather), summed into `flat` on completion.
  // Between two hosts (startSliceExchange) the slice partials are all-gathered instead:
  // `partials` gets every host's, folded into `flat` in host order (`dt` the shared-memory dtype).
  struct GlooReduction {
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor flat, sent;
    ReduceOp op;
    std::vector<at::Tensor> packets;
    std::vector<at::Tensor> partials;
    DataType dt = DataType::kFloat32;
  };
  // Two hosts: the slice partial `flat` and the other host's are swapped (a Gloo all_gather in the
  // slice group, one message each way instead of Gloo's all_reduce steps) and summed in host order,
  // the same bits on both hosts. A reduce swaps them too (the link's other direction is idle).
  // `partials` (numHosts x flat's elements, flat's dtype) receives every host's partial.
  GlooReduction startSliceExchange(const at::Tensor& flat, const at::Tensor& partials, ReduceOp op, DataType dt);
  // Whether a sliced reduce of (dtype, op) passes the slices up a chain of hosts to the root's
  // (from three hosts, uncompressed; hierarchical_sliced.cc).
  bool chainsReduce(at::ScalarType dtype, ReduceOp op) const;
  // Whether TDX_XHOST_COMPRESS applies to a reduction of (dtype, op): float32 SUM/AVG only.
  static bool compressesOnLink(at::ScalarType dtype, ReduceOp op);
  // Whether the slice reductions of (dtype, op) may run as startSliceExchange.
  bool exchangesSlices(at::ScalarType dtype, ReduceOp op) const;
  // `root` >= 0: a Gloo reduce to that rank of `pg` instead.
  GlooReduction startGlooAllreduce(c10d::Backend& pg, const at::Tensor& flat, ReduceOp op, int root = -1);
  // Gloo's op for `op` (AVG as SUM: the caller divides by the group size).
  static c10d::ReduceOp::RedOpType glooOp(ReduceOp op);
  void finishGlooAllreduce(GlooReduction& r, const WaitContext& ctx);
  void glooAllreduce(c10d::Backend& pg, const at::Tensor& flat, ReduceOp op, const WaitContext& ctx);
  // The route of one call (hierarchical_route.cc): true for one Gloo operation over all ranks,
  // false for the sliced algorithm. The same on every rank: it depends only on the operation, its
  // bytes (agreed), the knobs (agreed in attachLocal) and the link rate (agreed there).
  bool flatRoute(OpCode op, uint64_t bytes, at::ScalarType dtype = at::kByte, ReduceOp redop = ReduceOp::kSum) const;
  // A reduce of this many bytes runs as an all_reduce (every rank gets the result; the callers
  // pass copies on the ranks other than the root).
  bool reduceAsAllreduce(uint64_t bytes) const;
  // Measures the host link rate through the slice groups and agrees on it (attachLocal, auto only).
  void measureLink(const WaitContext& ctx);
  // reduce_scatter as one Gloo reduce_scatter over all ranks.
  void flatReduceScatter(const at::Tensor& output, const std::vector<at::Tensor>& blocks, const at::Tensor& whole,
                         ReduceOp op, const WaitContext& ctx);
  // A scratch tensor of `numel` elements of `dtype`, kept for the next call in `slot` (0 or 1) when
  // it is at most kKeepScratchBytes: the group's operations run one at a time, and a fresh
  // allocation of tens of MB costs more in page faults than the memory pass it serves.
  at::Tensor scratch(int slot, int64_t numel, at::ScalarType dtype);
  // Elements per pipeline chunk over `total` elements of t's dtype (hierarchical_sliced.cc).
  int64_t chunkElems(const at::Tensor& t, int64_t total) const;
  // Whether the host link measured at group creation is fast (hierarchical_route.cc).
  bool fastLink() const;
  // (host index, local index) of group rank `rank`.
  std::pair<int, int> placeOf(int rank) const;
  // The uniform-layout algorithms (hierarchical_sliced.cc): each byte crosses a host link once.
  // all_reduce: shared-memory reduce-scatter, Gloo all_reduce of this rank's slice across hosts,
  // shared-memory all-gather, chunk by chunk so the phases overlap.
  // `root` >= 0: a reduce; the slices go to the root's host, whose ranks gather them to the root.
  void slicedAllreduce(shm::ShmGroup& local, const at::Tensor& flat, int64_t blk, ReduceOp op, Agreement& a,
                       const WaitContext& ctx, int root = -1);
  // broadcast: across hosts by the ranks with the root's local index, then on each host.
  void slicedBroadcast(const std::vector<at::Tensor>& tensors, int root, const WaitContext& ctx);
  // all_gather of equal sizes: across hosts within each slice, then on each host.
  void slicedAllgather(const std::vector<at::Tensor>& outputs, const at::Tensor& input, const WaitContext& ctx);
  // reduce_scatter: on each host, then each host's partial of a block goes to that block's rank.
  void slicedReduceScatter(shm::ShmGroup& local, const at::Tensor& output, const std::vector<at::Tensor>& blocks,
                           ReduceOp op, Agreement& a, const WaitContext& ctx);

  HostLayout layout_;
  CrossHostFailures failures_;
  shm::ShmGroup* local_ = nullptr;
  bool fullChecks_ = false;
  double linkBytesPerSec_ = 0;  // per host link direction, measured by measureLink (0: not measured)
  uint64_t history_ = 0;  // over the descriptors passed to agree(), the same on every host
  at::Tensor scratch_[2];  // bytes, see scratch()
  int rank_;
  int size_;
  c10::intrusive_ptr<c10d::Backend> all_;
  c10::intrusive_ptr<c10d::Backend> slice_;
};

}  // namespace tdx
