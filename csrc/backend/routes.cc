#include "backend/routes.h"

#include <c10/util/Exception.h>

#include <cstdio>

#include "backend/host_engine.h"
#include "backend/staged_engine.h"
#include "common/env.h"
#include "common/logging.h"

namespace tdx {

Routes::Routes(std::unique_ptr<HostEngine> host, c10::intrusive_ptr<c10d::Store> store, GroupInfo info,
               std::vector<std::string> nodeIds)
    : host_(std::move(host)), store_(std::move(store)), info_(std::move(info)), nodeIds_(std::move(nodeIds)) {
  staged_ = std::make_unique<StagedEngine>(*host_, info_.rank);
}

Routes::~Routes() = default;

Engine& Routes::pick(const char* op, std::optional<at::Device> device, Reduction reduction, bool coalescing,
                     uint64_t nextSeq, std::chrono::milliseconds timeout) {
  if (!device) return *host_;
  if (planCuda(op, *device, nextSeq, timeout) != CudaRoute::kNccl) return *staged_;
  device_->checkUsable(op, *device);
  if (reduction && !device_->reduces(reduction->first, reduction->second)) {
    TORCH_CHECK(!device_->coalescing(), "tdx: ", op, ": this dtype / reduce op has no NCCL equivalent and is staged "
                "through host memory, which cannot run inside a coalescing block; call it outside the block");
    return *staged_;
  }
  if (coalescing) device_->joinCoalescing();
  return *device_;
}

std::vector<std::string> Routes::exchangeGpus(const char* op, at::Device device, uint64_t nextSeq,
                                              std::chrono::milliseconds timeout) {
  // Collective: every rank reaches its first CUDA call of the group at the same collective.
  const int rank = info_.rank, size = info_.size;
  std::vector<std::string> gpus(size);
  gpus[rank] = cudaRegistration()->gpuIdentity(device.index());
  auto key = [](int r) { return str("tdx/cuda/gpu/", r); };
  store_->set(key(rank), std::vector<uint8_t>(gpus[rank].begin(), gpus[rank].end()));
  std::vector<std::string> others;
  for (int r = 0; r < size; ++r) {
    if (r != rank) others.push_back(key(r));
  }
  try {
    store_->wait(others, timeout);
  } catch (const c10::Error&) {  // the store's own timeout names a key; name the collective and the ranks
    std::vector<int> missing;
    for (int r = 0; r < size; ++r) {
      if (r != rank && !store_->check({key(r)})) missing.push_back(r);
    }
    throw TimeoutError(str("tdx: ", op, " (sequence ", nextSeq, ") in group '", info_.name, "' timed out after ",
                           timeout.count(), " ms on rank ", info_.describeRank(rank), ": ranks ",
                           info_.describeRanks(missing), " did not arrive at the group's first CUDA collective "
                           "(where the ranks tell each other their GPUs). They may have crashed, be stuck, or be "
                           "running a different collective; raise the timeout in init_process_group(timeout=...) "
                           "if they are only slow"));
  }
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    auto v = store_->get(key(r));
    gpus[r] = std::string(v.begin(), v.end());
  }
  return gpus;
}

CudaRoute Routes::planCuda(const char* op, at::Device device, uint64_t nextSeq, std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  if (cudaRoute_) return *cudaRoute_;
  CudaRoutePlan plan;
  try {
    if (cudaRegistration()) {
      plan = planCudaRoute(nodeIds_, exchangeGpus(op, device, nextSeq, timeout), env().cudaPath);
    } else {
      TDX_ENFORCE(env().cudaPath != "nccl", "TDX_CUDA_PATH=nccl but this build of tdx has no NCCL path (it was "
                  "built without CUDA: torch had no CUDA or nvcc was missing); rebuild with nvcc on PATH, or unset it");
      plan.route = CudaRoute::kStaged;
      plan.reason = "staged through host shared memory (this build of tdx has no NCCL path)";
    }
  } catch (const Error& e) {
    TORCH_CHECK(false, e.what(), " (group '", info_.name, "', first CUDA call: ", op, ")");
  }
  if (plan.route == CudaRoute::kNccl) device_ = cudaRegistration()->makeEngine(store_, info_, device);
  if (env().debug && info_.rank == 0) {
    std::fprintf(stderr, "tdx: group '%s': CUDA tensors go %s\n", info_.name.c_str(), plan.reason.c_str());
  }
  cudaRoute_ = plan.route;
  return plan.route;
}

void Routes::shutdown() {
  host_->shutdown();
  if (device_) device_->shutdown();
}

void Routes::abort() {
  if (device_) device_->abort();
  host_->abort();
}

}  // namespace tdx
