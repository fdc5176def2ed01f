#include "backend/cuda_staging.h"

#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include "backend/work.h"

namespace tdx {

std::optional<at::Device> cudaDeviceOf(const char* op, const std::vector<at::Tensor>& tensors) {
  const at::Tensor* first = nullptr;
  bool anyCuda = false;
  for (const auto& t : tensors) {
    if (!t.defined()) continue;
    anyCuda = anyCuda || t.is_cuda();
    if (!first) {
      first = &t;
    } else {
      TORCH_CHECK_VALUE(t.device() == first->device(), "tdx: ", op, ": the tensors of one call are on different "
                        "devices (", first->device(), " and ", t.device(), "); put every input and output of a call "
                        "on the same device (one GPU per rank, or the CPU)");
    }
  }
  if (!anyCuda) return std::nullopt;
  return first->device();
}

std::optional<at::Device> cudaDeviceOf(const char* op, const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> all;
  for (const auto& l : lists) all.insert(all.end(), l.begin(), l.end());
  return cudaDeviceOf(op, all);
}

HostStage::HostStage(const std::vector<at::Tensor>& device, bool copyIn) : device_(device) {
  host_.reserve(device.size());
  for (const auto& t : device) {
    // to() waits for the current stream: the copy sees what the caller queued before the call.
    host_.push_back(copyIn ? t.to(at::kCPU) : at::empty_like(t, t.options().device(at::kCPU)));
  }
}

void HostStage::copyBack() {
  for (size_t i = 0; i < device_.size(); ++i) device_[i].copy_(host_[i]);
}

std::vector<HostStage> stageLists(const std::vector<std::vector<at::Tensor>>& lists, bool copyIn) {
  std::vector<HostStage> stages;
  stages.reserve(lists.size());
  for (const auto& l : lists) stages.emplace_back(l, copyIn);
  return stages;
}

std::vector<std::vector<at::Tensor>> hostLists(std::vector<HostStage>& stages) {
  std::vector<std::vector<at::Tensor>> lists;
  for (auto& s : stages) lists.push_back(s.host());
  return lists;
}

c10::intrusive_ptr<c10d::Work> finishStaged(int rank, c10d::OpType type, const char* name, at::Device device,
                                            const c10::intrusive_ptr<c10d::Work>& hostWork,
                                            std::vector<HostStage*> back, std::vector<at::Tensor> outputs,
                                            int srcRank) {
  hostWork->wait();  // raises the host collective's error (DistBackendError) here
  if (srcRank < 0 && (type == c10d::OpType::RECV || type == c10d::OpType::RECVANYSOURCE)) {
    srcRank = hostWork->sourceRank();
  }
  c10::DeviceGuard guard(device);
  for (HostStage* s : back) s->copyBack();
  auto work = c10::make_intrusive<TdxWork>(rank, type, 0, name, std::move(outputs), std::nullopt,
                                           std::vector<c10::Device>{device});
  work->complete(nullptr, srcRank);
  return work;
}

StagedP2PWork::StagedP2PWork(int rank, c10d::OpType type, at::Device device, c10::intrusive_ptr<c10d::Work> hostWork,
                             std::shared_ptr<HostStage> back, at::Tensor tensor)
    : c10d::Work(rank, type, type == c10d::OpType::SEND ? "send" : "recv"),
      device_(device),
      hostWork_(std::move(hostWork)),
      back_(std::move(back)),
      tensor_(std::move(tensor)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                       std::vector<c10::Device>{device})) {}

void StagedP2PWork::finishOnce() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (done_) return;
  c10::DeviceGuard guard(device_);
  if (back_) back_->copyBack();
  done_ = true;
  completed_ = true;
  future_->markCompleted(c10::IValue(std::vector<at::Tensor>{tensor_}));
}

bool StagedP2PWork::isCompleted() {
  if (!hostWork_->isCompleted()) return false;
  if (hostWork_->exception()) std::rethrow_exception(hostWork_->exception());
  finishOnce();
  return true;
}

bool StagedP2PWork::wait(std::chrono::milliseconds timeout) {
  hostWork_->wait(timeout);
  finishOnce();
  return true;
}

}  // namespace tdx
