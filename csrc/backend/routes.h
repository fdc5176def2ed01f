// The route table: which engine runs a call. CPU tensors go to the group's host engine (shared
// memory, or hierarchical when the group spans hosts); CUDA tensors go to the device engine that
// csrc/cuda registers (NCCL) or are staged through host memory into the host engine. The CUDA
// route is planned once, at the group's first CUDA call, from every rank's GPU.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda_registry.h"
#include "backend/engine.h"
#include "tuning/cuda_route.h"
#include "transport/transport.h"

namespace tdx {

// The reduction of a call (dtype, op), when it reduces: a device engine may not reduce it.
using Reduction = std::optional<std::pair<DataType, ReduceOp>>;

class HostEngine;  // host_engine.h

class Routes {
 public:
  Routes(std::unique_ptr<HostEngine> host, c10::intrusive_ptr<c10d::Store> store, GroupInfo info,
         std::vector<std::string> nodeIds);
  ~Routes();

  // The engine of CPU tensors (also what refusals, shrinking and gone_ranks use).
  HostEngine& host() { return *host_; }
  // The engine of a call whose tensors are on `device` (nullopt: the CPU). `coalescing`: the call
  // is inside a coalescing block. `nextSeq` and `timeout` name the call if planning times out.
  Engine& pick(const char* op, std::optional<at::Device> device, Reduction reduction, bool coalescing,
               uint64_t nextSeq, std::chrono::milliseconds timeout);
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }
  const std::vector<std::string>& nodeIds() const { return nodeIds_; }
  // The device engine once the CUDA route chose it, else null.
  DeviceEngine* device() { return device_.get(); }
  void shutdown();
  void abort();

 private:
  CudaRoute planCuda(const char* op, at::Device device, uint64_t nextSeq, std::chrono::milliseconds timeout);
  std::vector<std::string> exchangeGpus(const char* op, at::Device device, uint64_t nextSeq,
                                        std::chrono::milliseconds timeout);

  std::unique_ptr<HostEngine> host_;
  std::unique_ptr<Engine> staged_;
  std::unique_ptr<DeviceEngine> device_;
  c10::intrusive_ptr<c10d::Store> store_;
  GroupInfo info_;
  std::vector<std::string> nodeIds_;
  std::mutex mu_;
  std::optional<CudaRoute> cudaRoute_;
};

}  // namespace tdx
