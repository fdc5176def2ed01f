// The "tdx" c10d backend: c10d glue only. Every override validates its call (errors at the call
// site), numbers it, picks one engine for it from the route table (routes.h) and hands the engine
// the validated arguments (engine.h). Collective overrides: tdx_collectives.cc; construction,
// point-to-point, barrier and coalescing: tdx_backend.cc.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/version.h>

#include "backend/engine.h"
#include "backend/flight_recorder.h"
#include "backend/routes.h"

// Backend::supportsShrinking / shrink are virtual from torch 2.13 on.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
#define TDX_SHRINK_OVERRIDE override
#else
#define TDX_SHRINK_OVERRIDE
#endif

namespace tdx {

class TdxBackend : public c10d::Backend {
 public:
  // `nodeIds[r]`: the host of group rank r. A group spanning hosts also gets its Gloo groups
  // (torchdist_ext/_backend.py builds both, for every group).
  TdxBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout,
             std::string groupName, std::vector<int64_t> globalRanks, std::vector<std::string> nodeIds,
             c10::intrusive_ptr<c10d::Backend> glooAll = {}, c10::intrusive_ptr<c10d::Backend> glooSlice = {});
  // The survivors' backend that shrink() returns: `routes` over the shrunk shared-memory group.
  struct Shrunk {};
  TdxBackend(Shrunk, int rank, int size, std::chrono::milliseconds timeout, GroupInfo info,
             std::unique_ptr<Routes> routes);
  ~TdxBackend() override;

  const std::string getBackendName() const override { return "tdx"; }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  void setTimeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }
  // Sequence numbers (torch's ProcessGroupWrapper under TORCH_DISTRIBUTED_DEBUG=DETAIL and its
  // flight recorder read them). Every rank of a group starts its collective counter at 0 when the
  // backend is built and advances it by one per collective, so the ranks agree without an
  // exchange: setting it is a no-op, the counter is read as is.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return collSeq_; }
  void shutdown() override;
  void abort() override;
  // Counts every tdx backend made, shut down or aborted in this process: a resolution of a group
  // name to its tdx backend (direct_ops.cc) holds while the count is unchanged.
  static uint64_t generation() { return generation_.load(std::memory_order_acquire); }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts = c10d::AllreduceCoalescedOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts = c10d::ReduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputLists, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts = c10d::GatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts = c10d::ScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplitSizes,
                                               std::vector<int64_t>& inputSplitSizes,
                                               const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  // torch.ops.tdx.* (direct_ops.cc): all_reduce, all_gather_into_tensor and reduce_scatter_tensor
  // as the overrides above run them (same checks, sequence number, route, engine and flight
  // recorder entry), synchronous and without a Work: each returns once the call has completed and
  // raises its error. A call the engine runs at once on this thread (shared memory, nothing queued)
  // allocates no Work, future or task.
  void allreduceNow(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts);
  void allgatherIntoTensorNow(at::Tensor& output, at::Tensor& input);
  void reduceScatterTensorNow(at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts);

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;

  // Shrinking (tdx_shrink.cc; torch's dist.shrink_group calls these): the ranks that are not
  // excluded form a new group over shared memory, without the store; across hosts the Gloo part
  // is re-formed among them through the store. SHRINK_ABORT (flag 1) first interrupts the
  // operations in flight here (shared-memory waits; Gloo's own cannot be interrupted).
  bool supportsShrinking() const TDX_SHRINK_OVERRIDE;
  c10::intrusive_ptr<c10d::Backend> shrink(const std::vector<int64_t>& ranksToExclude, int shrinkFlags = 0,
                                           const c10::intrusive_ptr<Options>& optsOverride = nullptr)
      TDX_SHRINK_OVERRIDE;
  // Survivors that span hosts need new Gloo groups, which Python builds (torchdist_ext/_backend.py
  // wraps shrink): shrinkMeeting says where and as whom they meet (the survivors' store prefix, this
  // rank, their size, the timeout, their hosts; every survivor calls it once per shrink), and
  // shrinkWith shrinks with the Gloo groups built there (null on one host).
  struct ShrinkMeeting {
    c10::intrusive_ptr<c10d::Store> store;
    int rank = 0;
    int size = 0;
    std::chrono::milliseconds timeout{0};
    std::vector<std::string> nodeIds;
    std::vector<int> exclude;  // sorted
  };
  // Checks the arguments as shrink does.
  ShrinkMeeting shrinkMeeting(const std::vector<int64_t>& ranksToExclude, int shrinkFlags,
                              const c10::intrusive_ptr<Options>& optsOverride);
  c10::intrusive_ptr<c10d::Backend> shrinkWith(const ShrinkMeeting& meeting, int shrinkFlags,
                                               c10::intrusive_ptr<c10d::Backend> glooAll,
                                               c10::intrusive_ptr<c10d::Backend> glooSlice);
  // Group rank -> why, for every rank whose process is gone or announced that it is failing
  // (a rank whose collective failed but that goes on is not listed). Ranks of other hosts are
  // known from their host mates' notes in the store (waits up to `noteWait` for one when none is
  // known; torchdist_ext derives it from TDX_FAILURE_DETECTION_S). With a stuck time set
  // (setStuckTimeout), also a host mate silent past it (it is fenced then).
  std::vector<std::pair<int64_t, std::string>> goneRanks(std::chrono::milliseconds noteWait) const;
  // This rank's stuck time (seconds; 0 turns the watch off, the default): once set, a host mate
  // waiting on this rank excludes (fences) it when it shows no progress for that long. Elastic
  // trainers set it.
  void setStuckTimeout(double seconds);
  // "" unless this rank was excluded from the group (fenced by its host mates); then why.
  std::string excluded() const;
  // Wakes every rank of this process blocked in this group's operations (collectives and p2p, in
  // shared memory and in Gloo) with an error naming the operation, its sequence number and
  // `reason` (which ranks went silent); the group refuses further operations and is then shrunk
  // (SHRINK_ABORT) or destroyed. The first half of the shrink-abort, callable from any thread.
  void interrupt(const std::string& reason);
  // The node ids of the hosts the last cross-host failure of this group named as failed or silent.
  std::vector<std::string> failedHosts() const;
  // Whether this group's ranks are on more than one host (its p2p then goes through Gloo); a group
  // made by shrink included.
  bool spansHosts() const;
  // From which output size this group's all_gather reads the peers' inputs directly (single copy,
  // collectives/allgather.cc); 0 where it does not (a group spanning hosts included).
  size_t singleCopyBytes() const;

  // Coalescing blocks (batch_isend_irecv, coalesced collectives): on the NCCL engine one
  // ncclGroupStart/End around the block; elsewhere the operations run as they come and the
  // block's Work completes when all of them have. Offered only where a device engine is built.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 6)
  bool supportsCoalescing() const override { return cudaRegistration() != nullptr; }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
#else
  void startCoalescing();
  c10::intrusive_ptr<c10d::Work> endCoalescing();
#endif

 private:
  // all_gather of several inputs with outputLists[i][p] receiving inputs[i] of rank p.
  c10::intrusive_ptr<c10d::Work> allgatherByInput(std::vector<std::vector<at::Tensor>>& outputLists,
                                                  std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts);
  c10::intrusive_ptr<c10d::Work> p2p(c10d::OpType type, std::vector<at::Tensor>& tensors, int peer, int tag);
  // The engine of a call on `device` (nullopt: the CPU); `reduction` when the call reduces.
  Engine& route(const char* op, std::optional<at::Device> device, Reduction reduction = std::nullopt);
  // A call about to be issued: what its engine is given and, with the flight recorder on
  // (flight_recorder.h), its record, which track() completes (or fails) with the call's Work.
  struct Issued {
    OpContext op;
    std::shared_ptr<trace::Call> record;
  };
  // Numbers the call `name` (`p2p`: among point-to-point calls; `peer`: the other rank) and
  // records it with its `inputs` (none given: the outputs, as for an in-place call). `wantsWork`
  // false: a synchronous call without a Work (the outputs are then not kept in the context).
  Issued context(const char* name, c10d::OpType type, const Tensors& outputs, bool asyncOp, bool p2p = false,
                 const Tensors& inputs = {}, int peer = -1, bool wantsWork = true);
  // Keeps the Work of a call issued inside a coalescing block; completes (or fails) `record`
  // when `w` does.
  c10::intrusive_ptr<c10d::Work> track(c10::intrusive_ptr<c10d::Work> w, std::shared_ptr<trace::Call> record);
  // Hands the call `c` to its engine (`start` calls the engine's operation): returns its tracked
  // Work, or, for a call that wants no Work, returns null once the call has completed (its record
  // completed or failed here when the engine ran it at once, through track otherwise).
  template <typename Start>
  c10::intrusive_ptr<c10d::Work> issue(const Issued& c, Start&& start) {
    if (c.op.wantsWork) return track(start(), c.record);
    c10::intrusive_ptr<c10d::Work> w;
    try {
      w = start();
    } catch (...) {
      if (c.record) c.record->failed(std::current_exception());
      throw;
    }
    if (w) {
      track(w, c.record)->wait();
    } else if (c.record) {
      c.record->completed();
    }
    return {};
  }
  // The bodies of allreduce, allgather_into_tensor_coalesced and reduce_scatter_tensor_coalesced,
  // with or without a Work (`wantsWork`, OpContext).
  c10::intrusive_ptr<c10d::Work> allreduceCall(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts,
                                               bool wantsWork);
  // The flat calls take their (unchecked) tensors in the engine's argument, which they check and
  // hand on, so that a direct op builds its one-tensor lists once.
  c10::intrusive_ptr<c10d::Work> allgatherFlatCall(FlatArgs a, const c10d::AllgatherOptions& opts, bool wantsWork);
  c10::intrusive_ptr<c10d::Work> reduceScatterFlatCall(FlatArgs a, const c10d::ReduceScatterOptions& opts,
                                                       bool wantsWork);
  void checkAlive(const char* op) const;
  void checkRoot(const char* op, int64_t root) const;
  // Runs a collective's argument checks. A refusal raises here; on one host it is also posted for
  // this call's sequence number, so peers already waiting in the call (their own arguments were
  // fine) raise at once quoting it instead of at the timeout. The call's sequence number is used
  // up, as on the peers; when every rank refused the same call the group goes on.
  template <typename Checks>
  void refusable(const char* op, Checks&& checks) {  // a template: no std::function on every call
    try {
      checks();
    } catch (const std::exception& e) {
      postRefusal(op, e);
      throw;
    }
  }
  void postRefusal(const char* op, const std::exception& e);
  // A gather's or scatter's checked arguments: `one` is what every rank passes (a gather's input, a
  // scatter's output), `lists` the root's list; returns the root's list, sets `dev`.
  Tensors rootedArgs(const char* op, const std::vector<Tensors>& lists, const Tensors& one, const char* oneName,
                     const char* listName, int64_t root, std::optional<at::Device>& dev);
  void checkPeer(const char* op, int peer) const;

  std::chrono::milliseconds timeout_;
  GroupInfo info_;
  std::unique_ptr<Routes> routes_;
  uint64_t collSeq_ = 0;
  uint32_t shrinks_ = 0;  // shrinks of this group begun here (names each one's store prefix)
  uint64_t p2pSeq_ = 0;
  std::atomic<bool> shutdown_{false};
  static inline std::atomic<uint64_t> generation_{0};
  static void groupsChanged() { generation_.fetch_add(1, std::memory_order_acq_rel); }
  bool coalescing_ = false;
  std::vector<c10::intrusive_ptr<c10d::Work>> coalesced_;
  std::unique_ptr<trace::GroupRecorder> recorder_;  // only with the flight recorder on
};

// Whether c10d's option structs carry asyncOp (torch >= 2.8); older ones are always async.
template <typename T, typename = void>
struct HasAsyncOp : std::false_type {};
template <typename T>
struct HasAsyncOp<T, std::void_t<decltype(std::declval<T>().asyncOp)>> : std::true_type {};
template <typename T>
bool isAsyncOp(const T& opts) {
  if constexpr (HasAsyncOp<T>::value) {
    return opts.asyncOp;
  } else {
    return true;
  }
}

}  // namespace tdx
