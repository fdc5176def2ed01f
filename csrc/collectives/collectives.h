// Collectives over the shared-memory transport: an options struct and a free function each.
//
// Every function is called by all ranks of the group with matching arguments, runs to
// completion on the calling thread, and throws tdx::Error (or TimeoutError / AbortedError)
// on mismatch, timeout or abort. `ctx.seq` numbers the operation for error messages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "collectives/types.h"
#include "transport/shm/shm_group.h"

namespace tdx {

using shm::ShmGroup;

enum class AllreduceAlgorithm { kAuto, kOneShot, kReduceScatterAllgather };
// AllreduceOptions::oneshotBytes that means the plan's limit (tuning::oneshotLimit).
constexpr size_t kAutoOneshot = SIZE_MAX;

struct AllreduceOptions {
  SpanList in;           // this rank's contribution (may be the same memory as `out`)
  SpanList out;          // result, same total size as `in`
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int root = -1;         // >= 0: only `root` receives the result (the reduce collective)
  AllreduceAlgorithm algorithm = AllreduceAlgorithm::kAuto;
  size_t oneshotBytes = kAutoOneshot;  // kAuto picks one-shot up to this size (TDX_ONESHOT_BYTES)
  // != 1: every rank's input is multiplied by `scale` (rounded to the dtype) before the sum
  // (PREMUL_SUM; op must be kSum and the dtype floating). Costs no extra pass over the data.
  double scale = 1.0;
};
void allreduce(ShmGroup& g, const AllreduceOptions& o, const WaitContext& ctx);

struct BroadcastOptions {
  SpanList data;  // read on the root, written on the others
  int root = 0;
};
void broadcast(ShmGroup& g, const BroadcastOptions& o, const WaitContext& ctx);

struct AllgatherOptions {
  Span in{nullptr, 0};
  std::vector<Span> out;  // one per rank (sizes may differ); empty on non-roots of a gather
  int root = -1;          // >= 0: gather to `root` only
};
void allgather(ShmGroup& g, const AllgatherOptions& o, const WaitContext& ctx);

struct ScatterOptions {
  std::vector<Span> in;  // one per rank, on the root only
  Span out{nullptr, 0};
  int root = 0;
};
void scatter(ShmGroup& g, const ScatterOptions& o, const WaitContext& ctx);

struct ReduceScatterOptions {
  std::vector<Span> in;  // one block per rank, each out.bytes long
  Span out{nullptr, 0};
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
};
void reduceScatter(ShmGroup& g, const ReduceScatterOptions& o, const WaitContext& ctx);

struct AlltoallOptions {
  std::vector<Span> in;   // block for each destination rank
  std::vector<Span> out;  // block from each source rank
};
void alltoall(ShmGroup& g, const AlltoallOptions& o, const WaitContext& ctx);

void barrier(ShmGroup& g, const WaitContext& ctx);

}  // namespace tdx
