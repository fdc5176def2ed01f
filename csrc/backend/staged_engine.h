// The staged engine: CUDA tensors moved through host memory and the group's host engine. Used when
// ranks share a GPU (NCCL refuses them), for what NCCL cannot reduce (int16, bool, bitwise ops),
// when TDX_CUDA_PATH=staged, and in builds without csrc/cuda. No CUDA API: ATen's device copies.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <functional>
#include <memory>
#include <vector>

#include "backend/engine.h"

namespace tdx {

// Host copies of CUDA tensors. Construction copies device -> host (after the work queued on the
// current stream, i.e. the data the caller sees); copyBack() writes the host values back.
class HostStage {
 public:
  HostStage() = default;
  HostStage(const Tensors& device, bool copyIn);
  Tensors& host() { return host_; }
  void copyBack();

 private:
  Tensors device_;
  Tensors host_;
};

class StagedEngine : public Engine {
 public:
  StagedEngine(Engine& host, int rank) : host_(host), rank_(rank) {}
  TDX_ENGINE_OVERRIDES

 private:
  // Waits for the host operation, copies `back` to the device and returns a completed Work whose
  // future is CUDA-aware (events on the device's current stream). A host error is raised here.
  WorkPtr finish(const OpContext& c, at::Device device, const WorkPtr& hostWork, std::vector<HostStage*> back);
  // Stages `inputs` (copied in) and `outputs` (written back) and runs `call` on the host copies.
  using HostCall = std::function<WorkPtr(Tensors outputs, Tensors inputs, const OpContext& hostContext)>;
  WorkPtr inOut(const Tensors& outputs, const Tensors& inputs, const OpContext& c, const HostCall& call);
  WorkPtr p2p(P2PArgs a, const OpContext& c, bool isSend);

  Engine& host_;
  int rank_;
};

// A staged send or receive: the host operation runs asynchronously (a synchronous staged send
// could deadlock two ranks that both send before they receive); wait() waits for it and, for a
// receive, copies the host buffer to the device tensor on the waiter's current stream.
class StagedP2PWork : public c10d::Work {
 public:
  StagedP2PWork(int rank, c10d::OpType type, at::Device device, WorkPtr hostWork, std::shared_ptr<HostStage> back,
                at::Tensor tensor);
  bool isCompleted() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  int sourceRank() const override { return hostWork_->sourceRank(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return {tensor_}; }

 private:
  void finishOnce();

  at::Device device_;
  WorkPtr hostWork_;
  std::shared_ptr<HostStage> back_;
  at::Tensor tensor_;
  bool done_ = false;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace tdx
