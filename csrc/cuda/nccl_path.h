// The NCCL path for CUDA tensors (csrc/cuda: built only with CUDA): one communicator per process
// group (created at the group's first CUDA collective, from an ncclUniqueId exchanged through
// the c10d store), one communication stream that waits on the caller's current stream through an
// event, Works with CUDA-aware futures, ncclGroupStart/End around every call and around a
// coalescing block (batch_isend_irecv, coalesced collectives), and a watchdog thread that checks
// ncclCommGetAsyncError and the per-op timeout, aborts the communicator and fails the pending
// Works with the same kind of message as the shared-memory path (op, sequence, missing ranks).
//
// Inputs arrive validated by TdxBackend (devices, dtypes, sizes); operations NCCL cannot do
// (reductions over int16 / bool, bitwise ops) never reach it (Routes::pick asks NcclEngine).
// nccl_engine.cc adapts it to the Engine interface and registers it into the route table.
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda/nccl_work.h"
#include "collectives/types.h"
#include "cuda/nccl_comm.h"
#include "transport/transport.h"

namespace tdx {

// This rank's GPU identity for planCudaRoute: the device's UUID (falls back to its PCI bus id).
std::string gpuIdentity(int device);

class NcclPath {
 public:
  NcclPath(c10::intrusive_ptr<c10d::Store> store, GroupInfo info, at::Device device);
  ~NcclPath();

  at::Device device() const { return device_; }
  // Throws when the communicator failed earlier, or `d` is not this group's GPU.
  void checkUsable(const char* op, at::Device d) const;

  using Tensors = std::vector<at::Tensor>;
  using Ptr = c10::intrusive_ptr<c10d::Work>;
  // Every call: `seq` is the group's sequence number, `timeout` the group's timeout.
  Ptr allreduce(const Tensors& ts, DataType dt, ReduceOp op, uint64_t seq, std::chrono::milliseconds timeout);
  Ptr reduce(const Tensors& ts, DataType dt, ReduceOp op, int root, uint64_t seq, std::chrono::milliseconds timeout);
  Ptr broadcast(const Tensors& ts, int root, uint64_t seq, std::chrono::milliseconds timeout);
  // outputs[i] has world-size times inputs[i]'s elements (all_gather_into_tensor layout).
  Ptr allgatherFlat(const Tensors& outputs, const Tensors& inputs, const char* name, c10d::OpType type,
                    uint64_t seq, std::chrono::milliseconds timeout);
  // outputLists[i][p] receives inputs[i] of rank p.
  Ptr allgatherLists(const std::vector<Tensors>& outputLists, const Tensors& inputs, uint64_t seq,
                     std::chrono::milliseconds timeout);
  Ptr gather(const Tensors& outputs, const at::Tensor& input, int root, uint64_t seq,
             std::chrono::milliseconds timeout);
  Ptr scatter(const at::Tensor& output, const Tensors& inputs, int root, uint64_t seq,
              std::chrono::milliseconds timeout);
  // inputs[i] has world-size times outputs[i]'s elements.
  Ptr reduceScatterFlat(const Tensors& outputs, const Tensors& inputs, DataType dt, ReduceOp op, const char* name,
                        c10d::OpType type, uint64_t seq, std::chrono::milliseconds timeout);
  // Byte blocks: rank p gets inBytes[p] bytes from this rank's input, this rank receives outBytes[p].
  Ptr alltoallBytes(const Tensors& outputs, const Tensors& inputs, const std::vector<int64_t>& outBytes,
                    const std::vector<int64_t>& inBytes, const char* name, c10d::OpType type, uint64_t seq,
                    std::chrono::milliseconds timeout);
  Ptr send(const at::Tensor& t, int peer, uint64_t seq, std::chrono::milliseconds timeout);
  Ptr recv(const at::Tensor& t, int peer, uint64_t seq, std::chrono::milliseconds timeout);

  // Coalescing: between the two, calls are queued inside one ncclGroupStart/End; the Work of
  // endCoalescing covers all of them.
  void startCoalescing();
  Ptr endCoalescing(uint64_t seq, std::chrono::milliseconds timeout);
  bool coalescing() const { return coalescing_; }

  // Waits for the communication stream (for barrier()).
  void synchronize();
  void abort();
  void shutdown();

 private:
  using Issue = std::function<void(ncclComm_t, cudaStream_t)>;
  // Contiguous stand-ins for non-contiguous tensors; `copyBack` pairs are written after the op.
  struct Prepared {
    Tensors data;
    std::vector<std::pair<at::Tensor, at::Tensor>> copyBack;  // (contiguous stand-in, user tensor)
  };
  Prepared prepare(const Tensors& ts, bool copyIn);
  // Inputs (copied in), outputs (written back after the op) and every tensor the Work holds.
  struct InOut {
    Prepared in, out;
    Tensors held;
  };
  InOut prepareInOut(const Tensors& inputs, const Tensors& outputs);
  // gather (toRoot: the root receives outputs[r] from rank r) or scatter (the root sends inputs[r]).
  Ptr rooted(const char* name, c10d::OpType type, bool toRoot, const Tensors& outputs, const Tensors& inputs,
             int root, uint64_t seq, std::chrono::milliseconds timeout);
  Ptr launch(const char* name, c10d::OpType type, uint64_t seq, std::chrono::milliseconds timeout,
             Tensors outputs, Tensors held, std::vector<std::pair<at::Tensor, at::Tensor>> copyBack,
             const Issue& issue);
  void watch();
  void failAll(const std::string& msg, bool timedOut);
  std::string missingRanks(uint64_t seq);

  c10::intrusive_ptr<c10d::Store> store_;
  GroupInfo info_;
  at::Device device_;
  std::unique_ptr<nccl::NcclComm> comm_;
  c10::cuda::CUDAStream stream_;

  bool coalescing_ = false;
  std::vector<c10::intrusive_ptr<NcclWork>> coalesced_;
  std::vector<std::pair<at::Tensor, at::Tensor>> coalescedCopyBack_;
  Tensors coalescedHeld_, coalescedOutputs_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::list<c10::intrusive_ptr<NcclWork>> pending_;
  std::string failure_;
  std::atomic<bool> stop_{false};
  std::thread watchdog_;
};

}  // namespace tdx

