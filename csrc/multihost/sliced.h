// The sliced algorithms across hosts, for layouts where every host has the same number of ranks
// L: each local rank j carries 1/L of the bytes across hosts through its slice group (the ranks with
// local index j on every host), so every byte crosses a host link once and all L links' flows run
// at once; the shared-memory phases run chunk by chunk beside the network transfers. One file per
// algorithm (<op>_sliced.cc), each an options struct and a free function; the plan
// (tuning/plan.h) chooses among them and their variants.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "multihost/link.h"
#include "multihost/mismatch_check.h"
#include "tuning/plan.h"

namespace tdx {

// The Gloo p2p tag of the chained algorithms' chunks (the slice groups carry no other p2p).
inline constexpr int kChainTag = 1;

// all_reduce (reduce to `root` >= 0) of `flat` in place: a shared-memory reduce-scatter of each
// chunk, its slice across hosts (`link`: Gloo's all_reduce, or reduce to the root's host, in the
// slice group; a slice exchange between two hosts; a chain of hosts ending at the root's), then a
// shared-memory all-gather (a gather to the root); two chunks on the wire at once. The first
// reduce-scatter confirms the operation's agreement `a`.
struct SlicedAllreduceOptions {
  at::Tensor flat;        // blk * L elements
  int64_t blk = 0;        // elements of each local rank's slice
  ReduceOp op = ReduceOp::kSum;
  int root = -1;
  tuning::LinkAlgo link = tuning::LinkAlgo::kGlooSlices;
  std::string compress = "none";  // the slices' form on the link (kGlooSlices)
  uint64_t chunkFloorBytes = 0;
};
void slicedAllreduce(Link& link, MismatchCheck& check, Agreement& a, const SlicedAllreduceOptions& o,
                     const WaitContext& ctx);

// broadcast from group rank `root`: across hosts by the ranks with the root's local index, down a
// chain of hosts starting at the root's, then on each host, chunk by chunk as the chunks arrive.
// The first transfer across hosts is posted before the host's ranks confirm `a`.
void slicedBroadcast(Link& link, MismatchCheck& check, Agreement& a, const std::vector<at::Tensor>& tensors, int root,
                     uint64_t chunkFloorBytes, const WaitContext& ctx);

// all_gather of equal sizes: across hosts within each slice, then on each host (`direct`: each
// host's part gathered straight into the outputs).
void slicedAllgather(Link& link, const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                     uint64_t chunkFloorBytes, bool direct, const WaitContext& ctx);

// reduce_scatter: `output` gets block `rank` of the reduction of `blocks`; on each host first, then
// each host's partial of a block goes to that block's host. The first reduce-scatter confirms `a`.
void slicedReduceScatter(Link& link, MismatchCheck& check, Agreement& a, const at::Tensor& output,
                         const std::vector<at::Tensor>& blocks, ReduceOp op, uint64_t chunkFloorBytes,
                         const WaitContext& ctx);

}  // namespace tdx
