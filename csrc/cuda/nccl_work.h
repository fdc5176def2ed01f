// The Work of an operation on the NCCL path (csrc/cuda: built only with CUDA).
//
// Like torch's NCCL backend, the future is completed when the operation is queued: it is
// CUDA-aware (marked on the communication stream), so a callback or a waiter's stream runs after
// the NCCL kernels; wait() makes the caller's current stream wait for the end event. The Work
// holds every tensor of the operation until the end event has passed (allocator safety, together
// with recordStream). Errors and timeouts are found by the path's watchdog thread and raised by
// wait() / is_completed().
#pragma once

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <exception>
#include <vector>

namespace tdx {

class NcclWork : public c10d::Work {
 public:
  NcclWork(int rank, c10d::OpType type, uint64_t seq, const char* name, at::Device device,
           std::vector<at::Tensor> outputs, std::vector<at::Tensor> held);

  // Called once the NCCL calls are queued on `stream`: records the end event, completes the
  // future on that stream and starts the timeout clock.
  void launched(const c10::cuda::CUDAStream& stream, std::chrono::milliseconds timeout);

  bool isCompleted() override;
  bool isSuccess() const override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return outputs_; }
  uint64_t getSequencenumber() const override { return seq_; }

  // For the watchdog: whether the end event has passed (then the held tensors are released).
  bool finishedOnDevice();
  bool pastDeadline() const { return launched_ && std::chrono::steady_clock::now() > deadline_; }
  bool isLaunched() const { return launched_; }
  void fail(std::exception_ptr err);
  const char* name() const { return name_; }

 private:
  void throwIfFailed();

  uint64_t seq_;
  const char* name_;
  at::Device device_;
  std::vector<at::Tensor> outputs_;
  std::vector<at::Tensor> held_;
  at::cuda::CUDAEvent end_;
  bool launched_ = false;
  std::chrono::steady_clock::time_point deadline_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::exception_ptr error_;
};

}  // namespace tdx

