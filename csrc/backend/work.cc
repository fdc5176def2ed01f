#include "backend/work.h"

#include <c10/util/Exception.h>

#include "common/logging.h"

namespace tdx {

TdxWork::TdxWork(int rank, c10d::OpType type, uint64_t seq, const char* profilingTitle,
                 std::vector<at::Tensor> outputs, const std::optional<std::vector<at::Tensor>>& inputs,
                 std::vector<c10::Device> devices)
    : c10d::Work(rank, type, profilingTitle, inputs),
      seq_(seq),
      outputs_(std::move(outputs)),
      devices_(std::move(devices)) {
  // A CUDA-aware future records its events when it completes: made now, completed with the Work.
  if (!devices_.empty()) future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors(), devices_);
}

c10::intrusive_ptr<c10::ivalue::Future> TdxWork::getFuture() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!future_) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors(), devices_);
    if (settled_) settle(*future_, err_);
  }
  return future_;
}

void TdxWork::settle(c10::ivalue::Future& f, const std::exception_ptr& err) {
  if (err) {
    f.setError(err);
  } else {
    f.markCompleted(c10::IValue(outputs_));
  }
}

int TdxWork::sourceRank() const {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(completed_, "tdx: source_rank() is only known after the receive has completed; call wait() first");
  return srcRank_;
}

void TdxWork::complete(std::exception_ptr err, int srcRank) {
  err = toTorchError(err);
  c10::intrusive_ptr<c10::ivalue::Future> future;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    srcRank_ = srcRank;
    settled_ = true;
    err_ = err;
    future = future_;
  }
  // The future first: a caller that returns from wait() may read the future's value at once.
  if (future) settle(*future, err);
  finish(err);
}

std::exception_ptr toTorchError(std::exception_ptr err) {
  if (!err) return err;
  try {
    std::rethrow_exception(err);
  } catch (const Error& e) {
    return std::make_exception_ptr(c10::DistBackendError(c10::SourceLocation{__func__, __FILE__, __LINE__}, e.what()));
  } catch (...) {
    return err;
  }
}

}  // namespace tdx
