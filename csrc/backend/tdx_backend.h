// The "tdx" c10d backend: c10d glue over the shared-memory transport and collectives.
// Validates inputs (errors at the call site), orders collectives on one progress queue, runs
// point-to-point operations on the p2p engine, and reports failures through Work.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/version.h>

#include "backend/collective_queue.h"
#include "backend/hierarchical.h"
#include "backend/work.h"
#include "collectives/p2p.h"
#include "transport/device_sharing.h"
#include "transport/shm/shm_group.h"

namespace tdx {

#ifdef TDX_WITH_CUDA
class NcclPath;
#endif

class TdxBackend : public c10d::Backend {
 public:
  TdxBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout,
             std::string groupName, std::vector<int64_t> globalRanks, std::vector<std::string> nodeIds = {},
             c10::intrusive_ptr<c10d::Backend> glooAll = {}, c10::intrusive_ptr<c10d::Backend> glooSlice = {});
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
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;

  // The direct in-place ops (backend/direct_ops.cc, torch.ops.tdx.*): runs body(group, ctx) on the
  // calling thread as this group's next collective (after any queued ones), without a Work, and
  // returns true; errors reach the caller as torch errors. Returns false without running it when
  // the group spans hosts (the caller then takes the c10d path).
  bool runDirect(const char* name, const std::function<void(shm::ShmGroup&, const WaitContext&)>& body);

  // Coalescing blocks (batch_isend_irecv, coalesced collectives): on the NCCL path one
  // ncclGroupStart/End around the block; elsewhere the operations run as they come and the
  // block's Work completes when all of them have. Offered only where the NCCL path is built.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 6)
#ifdef TDX_WITH_CUDA
  bool supportsCoalescing() const override { return true; }
#endif
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
  // Runs `body` as collective number `seq` on the progress queue (inline when synchronous and
  // idle); `finish` runs after a successful body (copy-backs). Errors complete the Work.
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, const char* name, std::vector<at::Tensor> outputs,
                                         bool asyncOp, std::function<void(const WaitContext&)> body);
  c10::intrusive_ptr<c10d::Work> enqueueP2P(c10d::OpType type, const char* name, at::Tensor tensor, int peer,
                                            int tag);
  WaitContext contextFor(const char* name, uint64_t seq) const;

  // CUDA tensors (tdx_cuda.cc): the route is planned at the group's first CUDA call.
  CudaRoute cudaRoute(const char* op, at::Device device);
  // Whether this call goes to NCCL (false: stage through host memory). `reduction` is the
  // call's dtype and op when it reduces (NCCL cannot reduce int16 / bool or do bitwise ops).
  bool useNccl(const char* op, at::Device device, std::optional<std::pair<DataType, ReduceOp>> reduction);
  c10::intrusive_ptr<c10d::Work> track(c10::intrusive_ptr<c10d::Work> w);
  c10::intrusive_ptr<c10d::Work> hostCall(const std::function<c10::intrusive_ptr<c10d::Work>()>& call);
  c10::intrusive_ptr<c10d::Work> cudaAllreduce(at::Device dev, std::vector<at::Tensor>& tensors,
                                               const c10d::AllreduceOptions& opts);
  c10::intrusive_ptr<c10d::Work> cudaReduce(at::Device dev, std::vector<at::Tensor>& tensors,
                                            const c10d::ReduceOptions& opts);
  c10::intrusive_ptr<c10d::Work> cudaBroadcast(at::Device dev, std::vector<at::Tensor>& tensors,
                                               const c10d::BroadcastOptions& opts);
  c10::intrusive_ptr<c10d::Work> cudaAllgather(at::Device dev, std::vector<std::vector<at::Tensor>>& outputs,
                                               std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts);
  c10::intrusive_ptr<c10d::Work> cudaAllgatherInto(at::Device dev, std::vector<at::Tensor>& outputs,
                                                   std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts);
  c10::intrusive_ptr<c10d::Work> cudaGather(at::Device dev, std::vector<std::vector<at::Tensor>>& outputs,
                                            std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts);
  c10::intrusive_ptr<c10d::Work> cudaScatter(at::Device dev, std::vector<at::Tensor>& outputs,
                                             std::vector<std::vector<at::Tensor>>& inputs,
                                             const c10d::ScatterOptions& opts);
  c10::intrusive_ptr<c10d::Work> cudaReduceScatter(at::Device dev, std::vector<at::Tensor>& outputs,
                                                   std::vector<std::vector<at::Tensor>>& inputs,
                                                   const c10d::ReduceScatterOptions& opts);
  c10::intrusive_ptr<c10d::Work> cudaReduceScatterTensor(at::Device dev, std::vector<at::Tensor>& outputs,
                                                         std::vector<at::Tensor>& inputs,
                                                         const c10d::ReduceScatterOptions& opts);
  c10::intrusive_ptr<c10d::Work> cudaAlltoallBase(at::Device dev, at::Tensor& output, at::Tensor& input,
                                                  std::vector<int64_t>& outputSplitSizes,
                                                  std::vector<int64_t>& inputSplitSizes,
                                                  const c10d::AllToAllOptions& opts);
  c10::intrusive_ptr<c10d::Work> cudaAlltoall(at::Device dev, std::vector<at::Tensor>& outputs,
                                              std::vector<at::Tensor>& inputs, const c10d::AllToAllOptions& opts);
  c10::intrusive_ptr<c10d::Work> cudaP2P(at::Device dev, c10d::OpType type, at::Tensor& tensor, int peer, int tag);
  void checkAlive(const char* op) const;
  void checkRoot(const char* op, int64_t root) const;
  void checkPeer(const char* op, int peer) const;

  std::chrono::milliseconds timeout_;
  GroupInfo info_;
  std::unique_ptr<shm::ShmGroup> group_;  // this host's ranks only, in multi-host mode
  std::unique_ptr<Hierarchy> hier_;        // set only when the group spans hosts
  std::unique_ptr<P2PEngine> p2p_;
  std::unique_ptr<CollectiveQueue> queue_;
  uint64_t collSeq_ = 0;
  uint64_t p2pSeq_ = 0;
  std::atomic<bool> shutdown_{false};

  c10::intrusive_ptr<c10d::Store> store_;
  std::vector<std::string> nodeIds_;
  std::mutex cudaMu_;
  std::optional<CudaRoutePlan> cudaPlan_;
#ifdef TDX_WITH_CUDA
  std::unique_ptr<NcclPath> nccl_;
#endif
  bool coalescing_ = false;
  int hostCalls_ = 0;  // > 0 while a staged CUDA call runs its host operation
  std::vector<c10::intrusive_ptr<c10d::Work>> coalesced_;
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
