// Reductions on the link: a Gloo all_reduce (or reduce) of a flat tensor started and finished
// apart, so the sliced all_reduce keeps two chunks on the wire; what Gloo cannot reduce is mapped
// to what it can, exactly (AVG as SUM then divided, int16 widened, bool as bytes with OR / AND), and
// TDX_XHOST_COMPRESS's forms cross as half precision or int8 packets.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <string>
#include <vector>

#include "collectives/types.h"
#include "multihost/link.h"

namespace tdx {

// A Gloo reduction in flight. Under int8 (slice groups only) `sent` is this host's int8 packet and
// `packets` the packets of every host (a Gloo all_gather), summed into `flat` on completion. A
// slice exchange all-gathers the partials instead: `partials` gets every host's, folded into
// `flat` in host order (`dt` the shared-memory dtype).
struct GlooReduction {
  GlooWork work;
  at::Tensor flat, sent;
  ReduceOp op;
  std::vector<at::Tensor> packets;
  std::vector<at::Tensor> partials;
  DataType dt = DataType::kFloat32;
};

// Starts Gloo's all_reduce of `flat` on `pg` (`root` >= 0: a reduce to that rank of `pg`).
// `compress` ("none", "bf16", "fp16", "int8"; int8 only on the slice group) is the plan's form on the link.
GlooReduction startGlooAllreduce(Link& link, c10d::Backend& pg, const at::Tensor& flat, ReduceOp op,
                                 const std::string& compress, int root = -1);
// Two hosts: the slice partial `flat` and the other host's are swapped (a Gloo all_gather in the
// slice group, one message each way instead of Gloo's all_reduce steps) and summed in host order,
// the same bits on both hosts. `partials` (numHosts x flat's elements, flat's dtype) receives every
// host's partial.
GlooReduction startSliceExchange(Link& link, const at::Tensor& flat, const at::Tensor& partials, ReduceOp op,
                                 DataType dt);
// Waits for `r` and completes it (widened dtypes copied back, packets or partials summed, AVG divided).
void finishGlooAllreduce(Link& link, GlooReduction& r, const WaitContext& ctx);

// Gloo's op for `op` (AVG as SUM: the caller divides by the group size).
c10d::ReduceOp::RedOpType glooOp(ReduceOp op);

// The host link's rate per direction in bytes per second, agreed by every rank: every slice group
// all-reduces 1 MiB at once, as the sliced all_reduce does, and the slowest rank's time counts.
// Collective over the group (sliced layouts only).
double measureLinkRate(Link& link, const WaitContext& ctx);

}  // namespace tdx
