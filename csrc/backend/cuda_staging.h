// CUDA tensors in the tdx backend: which device a call is on, and the staged path that moves
// CUDA tensors through host memory and the shared-memory collectives. The staged path is used
// when ranks share a GPU (NCCL refuses them), for what NCCL cannot do (reductions over int16 or
// bool, bitwise ops), when TDX_CUDA_PATH=staged, and when tdx was built without NCCL.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <memory>
#include <optional>
#include <vector>

namespace tdx {

// The CUDA device of a call, or nullopt when every tensor is on the CPU (undefined tensors are
// skipped). Throws a ValueError naming both tensors when a call mixes devices.
std::optional<at::Device> cudaDeviceOf(const char* op, const std::vector<at::Tensor>& tensors);
std::optional<at::Device> cudaDeviceOf(const char* op, const std::vector<std::vector<at::Tensor>>& lists);

// Host copies of CUDA tensors. Construction copies device -> host (after the work queued on the
// current stream, i.e. the data the caller sees); copyBack() writes the host values back.
class HostStage {
 public:
  HostStage() = default;
  HostStage(const std::vector<at::Tensor>& device, bool copyIn);
  std::vector<at::Tensor>& host() { return host_; }
  void copyBack();

 private:
  std::vector<at::Tensor> device_;
  std::vector<at::Tensor> host_;
};
std::vector<HostStage> stageLists(const std::vector<std::vector<at::Tensor>>& lists, bool copyIn);
std::vector<std::vector<at::Tensor>> hostLists(std::vector<HostStage>& stages);

// Finishes a staged call: waits for the host collective, copies `back` to the device and returns
// a completed Work whose future is CUDA-aware (events on the current stream of `device`).
// An error of the host collective is raised here, from the call.
c10::intrusive_ptr<c10d::Work> finishStaged(int rank, c10d::OpType type, const char* name, at::Device device,
                                            const c10::intrusive_ptr<c10d::Work>& hostWork,
                                            std::vector<HostStage*> back, std::vector<at::Tensor> outputs,
                                            int srcRank = -1);

// A staged send or receive: the host operation runs asynchronously (a synchronous staged send
// could deadlock two ranks that both send before they receive); wait() waits for it and, for a
// receive, copies the host buffer to the device tensor on the waiter's current stream.
class StagedP2PWork : public c10d::Work {
 public:
  StagedP2PWork(int rank, c10d::OpType type, at::Device device, c10::intrusive_ptr<c10d::Work> hostWork,
                std::shared_ptr<HostStage> back, at::Tensor tensor);
  bool isCompleted() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  int sourceRank() const override { return hostWork_->sourceRank(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return {tensor_}; }

 private:
  void finishOnce();

  at::Device device_;
  c10::intrusive_ptr<c10d::Work> hostWork_;
  std::shared_ptr<HostStage> back_;
  at::Tensor tensor_;
  bool done_ = false;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace tdx
