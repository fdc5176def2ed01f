// NCCL communicators for CUDA tensors (csrc/cuda: built only with CUDA). No torch types: the
// backend passes raw device pointers and cudaStream_t.
//
// A communicator is created collectively: rank 0 makes an ncclUniqueId and publishes it through
// the Rendezvous (the c10d store), every rank reads it and calls ncclCommInitRank on its device.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <mutex>
#include <string>

#include "collectives/types.h"
#include "transport/transport.h"

namespace tdx {
namespace nccl {

// Throws tdx::Error naming the NCCL call and NCCL's own explanation.
void check(ncclResult_t r, const char* call, ncclComm_t comm = nullptr);
void checkCuda(cudaError_t e, const char* call);

class NcclComm {
 public:
  // Collective over the group: blocks until every rank has joined (NCCL's own rendezvous).
  NcclComm(Rendezvous& rdv, const std::string& key, int rank, int size, int device);
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  ncclComm_t get() const { return comm_; }
  int device() const { return device_; }
  // "" while healthy, else NCCL's asynchronous error (ncclCommGetAsyncError) as a sentence.
  std::string asyncError();
  // ncclCommAbort once (frees the communicator, interrupts kernels stuck in it); thread-safe.
  void abort();
  bool aborted() const { return aborted_.load(); }

 private:
  ncclComm_t comm_ = nullptr;
  int device_;
  std::mutex mu_;
  std::atomic<bool> aborted_{false};
};

// NCCL's type for a tdx dtype (float16/bfloat16/int8/uint8/int32/int64/float32/float64; bytes
// as uint8). Reductions over int16 and bool have no NCCL type: supportsReduce says false.
ncclDataType_t toNcclType(DataType dt);
bool supportsReduce(DataType dt, ReduceOp op);
ncclRedOp_t toNcclOp(ReduceOp op);

}  // namespace nccl
}  // namespace tdx

