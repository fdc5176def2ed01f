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
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                       std::move(devices))) {}

int TdxWork::sourceRank() const {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(completed_, "tdx: source_rank() is only known after the receive has completed; call wait() first");
  return srcRank_;
}

void TdxWork::complete(std::exception_ptr err, int srcRank) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    srcRank_ = srcRank;
  }
  err = toTorchError(err);
  // The future first: a caller that returns from wait() may read the future's value at once.
  if (err) {
    future_->setError(err);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
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
