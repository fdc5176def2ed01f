// The Work returned by every tdx operation: wait(), is_completed(), get_future() (a Future
// holding the output tensors, as DDP comm hooks expect) and source_rank() for receives.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <ATen/core/ivalue.h>

#include <exception>
#include <vector>

namespace tdx {

class TdxWork : public c10d::Work {
 public:
  // `devices`: the CUDA devices of the outputs (empty for CPU tensors); the future is then
  // CUDA-aware: completing it records an event on each device's current stream, and waiting on
  // it makes the waiter's current stream wait for that event.
  TdxWork(int rank, c10d::OpType type, uint64_t seq, const char* profilingTitle,
          std::vector<at::Tensor> outputs, const std::optional<std::vector<at::Tensor>>& inputs,
          std::vector<c10::Device> devices = {});

  // Made on the first call for CPU outputs (most calls are waited on and never asked for one);
  // one asked for after completion is returned completed.
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  std::vector<at::Tensor> result() override { return outputs_; }
  int sourceRank() const override;
  uint64_t getSequencenumber() const override { return seq_; }

  // Completes the work (and its future) once; `err` null means success.
  void complete(std::exception_ptr err, int srcRank = -1);

 private:
  // Completes `f` as complete() completed this Work (with `err`, or with the outputs).
  void settle(c10::ivalue::Future& f, const std::exception_ptr& err);

  uint64_t seq_;
  std::vector<at::Tensor> outputs_;
  std::vector<c10::Device> devices_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // guarded by mutex_
  bool settled_ = false;                            // complete() ran (guarded by mutex_)
  std::exception_ptr err_;                          // its error, for a future made later
  int srcRank_ = -1;
};

// Turns tdx::Error (and its timeout / abort kinds) into c10::DistBackendError, which Python
// sees as torch.distributed.DistBackendError; other exceptions pass through unchanged.
std::exception_ptr toTorchError(std::exception_ptr err);

}  // namespace tdx
