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
// AllreduceOptions::oneshotBytes that means autoOneshotBytes(group size).
constexpr size_t kAutoOneshot = SIZE_MAX;

struct AllreduceOptions {
  SpanList in;           // this rank's contribution (may be the same memory as `out`)
  SpanList out;          // result, same total size as `in`
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int root = -1;         // >= 0: only `root` receives the result (the reduce collective)
  AllreduceAlgorithm algorithm = AllreduceAlgorithm::kAuto;
  size_t oneshotBytes = kAutoOneshot;  // kAuto picks one-shot up to this size
  // != 1: every rank's input is multiplied by `scale` (rounded to the dtype) before the sum
  // (PREMUL_SUM; op must be kSum and the dtype floating). Costs no extra pass over the data.
  double scale = 1.0;
};
void allreduce(ShmGroup& g, const AllreduceOptions& o, const WaitContext& ctx);
// The one-shot limit for `ranks` ranks and `dtype` when none is set: 256 KiB / ranks^2, at most 128
// KiB and at least 4 KiB (64 KiB at 2 ranks, 16 KiB at 4, 4 KiB at 8); 4 KiB for fp16 and bf16.
// One-shot reads and folds ranks x bytes per rank in one synchronization; reduce-scatter +
// all-gather about 2 x bytes in two, so the size where one-shot stops paying falls faster than
// 1 / ranks. On 16 cores (docs/bench/cpu-16core-stream-ab.txt) one-shot at 8 ranks took 90-97 us
// for 64 KB, longer than reduce-scatter + all-gather for 256 KB (72-92 us); at 16 KB it took
// 23-30 us in four runs, where reduce-scatter + all-gather of bf16 (its fold converting every
// element) took 14.3 us in the same bench run (docs/bench/cpu-8rank-16core-anchors.txt); at 4
// ranks one-shot 16 KB took 14.0-15.1 us and bf16 reduce-scatter + all-gather 14.8, one-shot 64 KB
// 44 us and reduce-scatter + all-gather 25-28. A 16-bit fold converts every element to
// float and back, so it pays sooner: at 2 ranks, bf16 16 KB 7.5 us vs 12.4 one-shot, 64 KB 19.9
// vs 33.8; fp16 64 KB 15.8 vs 20.8 (fp32 64 KB one-shot 14.7 vs 15.3).
size_t autoOneshotBytes(int ranks, DataType dtype);

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
