#include "cuda/nccl_work.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

namespace tdx {

NcclWork::NcclWork(int rank, c10d::OpType type, uint64_t seq, const char* name, at::Device device,
                   std::vector<at::Tensor> outputs, std::vector<at::Tensor> held)
    : c10d::Work(rank, type, name),
      seq_(seq),
      name_(name),
      device_(device),
      outputs_(std::move(outputs)),
      held_(std::move(held)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                       std::vector<c10::Device>{device})) {}

void NcclWork::launched(const c10::cuda::CUDAStream& stream, std::chrono::milliseconds timeout) {
  end_.record(stream);
  {
    c10::cuda::CUDAStreamGuard guard(stream);
    future_->markCompleted(c10::IValue(outputs_));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  deadline_ = std::chrono::steady_clock::now() + timeout;
  launched_ = true;
}

bool NcclWork::finishedOnDevice() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!launched_ || error_) return false;
  if (!end_.query()) return false;
  held_.clear();
  completed_ = true;
  return true;
}

void NcclWork::fail(std::exception_ptr err) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (completed_ && !error_) return;
    error_ = err;
    exception_ = err;
    completed_ = true;
  }
  cv_.notify_all();
}

void NcclWork::throwIfFailed() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (error_) std::rethrow_exception(error_);
}

bool NcclWork::isCompleted() {
  throwIfFailed();
  return finishedOnDevice() || completed_;
}

bool NcclWork::isSuccess() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return !error_;
}

bool NcclWork::wait(std::chrono::milliseconds /*timeout*/) {
  throwIfFailed();
  TORCH_CHECK(launched_, "tdx: ", name_, " (sequence ", seq_, "): wait() was called inside a coalescing block, "
              "before the block ended; wait on the work the block returns instead");
  // Like torch's NCCL backend: the caller's stream waits; the host does not block. Errors and
  // timeouts found later are raised by the next wait() / collective.
  end_.block(c10::cuda::getCurrentCUDAStream(device_.index()));
  return true;
}

}  // namespace tdx

