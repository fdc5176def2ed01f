// The seam between the c10d backend and the engines that move a call's bytes (shared memory,
// hierarchical across hosts, NCCL, CUDA staged through host memory). TdxBackend validates a call,
// picks one engine for it (routes.h) and hands that engine the validated arguments below; an
// engine trusts them (devices, dtypes, sizes, roots are checked) and never calls back into the
// backend. Adding a collective: its arguments here, one virtual, one override per engine.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <cstdint>
#include <vector>

#include "collectives/types.h"

namespace tdx {

using Tensors = std::vector<at::Tensor>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// What every call carries besides its tensors.
struct OpContext {
  const char* name = "";  // torch's name of the operation (errors, profiling)
  c10d::OpType type = c10d::OpType::UNKNOWN;
  uint64_t seq = 0;       // the group's collective (or point-to-point) sequence number of this call
  bool asyncOp = true;    // false: the caller waits at once (the host engines may then run inline)
  // false (a synchronous call that wants no Work: torch.ops.tdx.*): an engine that runs the call
  // to its end before returning returns null and throws its error (c10d's error types); one that
  // does not returns a Work as always, which the backend waits for.
  bool wantsWork = true;
  std::chrono::milliseconds timeout{0};
  Tensors outputs;        // what the Work's result() and future hold
};

// all_reduce (root < 0) or reduce to `root`, in place over `tensors` as one logical array of one
// real dtype (complex tensors arrive as their real views); every element is multiplied by `scale`.
struct ReduceArgs {
  Tensors tensors;
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  double scale = 1.0;
  int root = -1;
};
struct BroadcastArgs {
  Tensors tensors;
  int root = 0;
};
// all_gather: outputs[i][p] receives inputs[i] of rank p.
struct AllgatherArgs {
  std::vector<Tensors> outputs;
  Tensors inputs;
};
// all_gather_into_tensor: outputs[i] holds world-size blocks, block p receiving inputs[i] of rank p.
// reduce_scatter_tensor: inputs[i] holds world-size blocks; outputs[i] gets the reduction of block rank.
struct FlatArgs {
  Tensors outputs;
  Tensors inputs;
  DataType dtype = DataType::kFloat32;  // reduce_scatter_tensor only
  ReduceOp op = ReduceOp::kSum;
};
// gather to `root` (`outputs`: the root's world-size list, empty elsewhere), or scatter from
// `root` (`outputs` holds the one output, `inputs` the root's list).
struct RootedArgs {
  Tensors outputs;
  Tensors inputs;
  int root = 0;
};
// reduce_scatter with one input per rank: output[0] gets the reduction of inputs[rank].
struct ReduceScatterArgs {
  at::Tensor output;
  Tensors inputs;
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
};
// all_to_all: either one output and one input, cut into per-rank blocks of outBytes[p] /
// inBytes[p] bytes (all_to_all_single), or one tensor per rank each side (all_to_all).
struct AlltoallArgs {
  Tensors outputs;
  Tensors inputs;
  std::vector<int64_t> outBytes, inBytes;
  bool single = false;
};
// send / recv; `peer` -1 receives from any source.
struct P2PArgs {
  at::Tensor tensor;
  int peer = -1;
  int tag = 0;
};

// The operations of an engine, one per collective family: X(name, argument type). The interface
// and every engine declare them from this one list.
#define TDX_ENGINE_OPS(X)                                                                       \
  X(allreduce, ReduceArgs) /* root >= 0: reduce */                                              \
  X(broadcast, BroadcastArgs)                                                                   \
  X(allgather, AllgatherArgs)                                                                   \
  X(allgatherFlat, FlatArgs)                                                                    \
  X(gather, RootedArgs)                                                                         \
  X(scatter, RootedArgs)                                                                        \
  X(reduceScatter, ReduceScatterArgs)                                                           \
  X(reduceScatterFlat, FlatArgs)                                                                \
  X(alltoall, AlltoallArgs)                                                                     \
  X(send, P2PArgs)                                                                              \
  X(recv, P2PArgs)
#define TDX_ENGINE_PURE(name, Args) virtual WorkPtr name(Args a, const OpContext& c) = 0;
#define TDX_ENGINE_OVERRIDE(name, Args) WorkPtr name(Args a, const OpContext& c) override;
// Declares every operation (and barrier) in an engine class.
#define TDX_ENGINE_OVERRIDES              \
  TDX_ENGINE_OPS(TDX_ENGINE_OVERRIDE)     \
  WorkPtr barrier(const OpContext& c) override;

class Engine {
 public:
  virtual ~Engine() = default;
  TDX_ENGINE_OPS(TDX_ENGINE_PURE)
  virtual WorkPtr barrier(const OpContext& c) = 0;  // no tensors: host engines only
  // Interrupts waits (shutdown may run while a collective waits) / drops the transport at once.
  virtual void shutdown() {}
  virtual void abort() {}
};

// An engine for CUDA tensors that another folder registers (csrc/cuda: NCCL). Beyond the
// collectives it says what it cannot do and groups a coalescing block into one launch.
class DeviceEngine : public Engine {
 public:
  // Throws when the engine failed earlier or `device` is not the group's GPU.
  virtual void checkUsable(const char* op, at::Device device) const = 0;
  // Whether it reduces `dtype` with `op` (false: the call is staged through host memory).
  virtual bool reduces(DataType dtype, ReduceOp op) const = 0;
  // Coalescing: joinCoalescing() (idempotent) opens a block the next calls join; endCoalescing
  // launches them together and returns the block's Work.
  virtual void joinCoalescing() = 0;
  virtual bool coalescing() const = 0;
  virtual WorkPtr endCoalescing(uint64_t seq, std::chrono::milliseconds timeout) = 0;
};

}  // namespace tdx
