// The multi-host mode of the tdx backend: shared memory inside each host, torch's Gloo between
// hosts. Built when a group's ranks report more than one node id; its Gloo groups come from
// Python (torchdist_ext/_backend.py), for a new group and a shrink alike.
//
// The wing, by idea:
//   layout.h            where each rank sits among the hosts
//   link.h              the Gloo groups and this host's group: waits that watch the host mates
//                       (gloo_wait.h), failure notes for the other hosts (failure_notes.h), scratch
//   gloo_reduce.h       reductions on the link (Gloo's, mapped exactly; compressed forms; the
//                       two-host slice exchange; the link's rate)
//   mismatch_check.h    do all ranks run the same collective
//   *_sliced.cc         one file per sliced algorithm (sliced.h): each byte crosses a host link once
//   flat.h, p2p.cc      one Gloo operation over all ranks; point-to-point
// Which of them a call takes is the plan's (tuning/plan.h): a pure function of the operation, its
// bytes, dtype and reduce op, the layout, the host link's rate measured once when the group is made
// (TDX_XHOST_ALGO=auto) and the knobs, so it is the same on every rank.
//
// all_reduce (and reduce / reduce_scatter, which are built on it): the ranks of a host
// reduce-scatter over shared memory so local rank j holds slice j of the host's partial result;
// slice j is all-reduced across hosts over a Gloo group made of the ranks with local index j on
// every host; a shared-memory all-gather then gives every rank the whole result. Gloo returns the
// same bits on every participant, so results are bit-identical on every rank. Hosts with unequal
// rank counts run one Gloo operation over the whole group (correct, slower).
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <string>
#include <vector>

#include "collectives/types.h"
#include "multihost/link.h"
#include "multihost/mismatch_check.h"
#include "transport/shm/shm_group.h"
#include "tuning/plan.h"

namespace tdx {

// What a group spanning hosts is made of besides this host's shared-memory group.
struct CrossHost {
  HostLayout layout;
  GlooGroups gloo;
  c10::intrusive_ptr<c10d::Store> store;  // the group's: failure notes between hosts
  std::vector<std::string> nodeIds;       // the host of each group rank
  std::vector<int64_t> globalRanks;       // group rank -> global rank (empty: the same), for errors
};

class Hierarchy {
 public:
  // `local`: this host's shared-memory group (outlives the Hierarchy). Collective over the group:
  // agrees on full mismatch checks (on everywhere as soon as one rank asks) and the cross-host
  // knobs, and measures the host link where the plan uses its rate.
  Hierarchy(shm::ShmGroup& local, int rank, int size, CrossHost x);

  const HostLayout& layout() const { return link_.layout(); }
  // The hosts the last cross-host failure named (Link::failedHosts).
  std::vector<std::string> failedHosts() const { return link_.failedHosts(); }

  // In place on contiguous tensors of one real (or bool) dtype, reduced as one logical array.
  // `root` >= 0: a reduce to that rank (checked as one; the ranks whose tensors the route writes
  // get the result too). `keepInputs`: `tensors` are left as they were (a non-root of a reduce;
  // copied first where the route would write them).
  void allreduce(const std::vector<at::Tensor>& tensors, ReduceOp op, const WaitContext& ctx, int root = -1,
                 bool keepInputs = false);
  // reduce_scatter: `output` gets block `rank` of the reduction of `blocks` (world-size contiguous
  // 1-D tensors of output.numel() elements, read only). `whole`, when defined, is one contiguous
  // tensor holding the blocks back to back (saves a concatenation where Gloo needs one).
  void reduceScatter(const at::Tensor& output, const std::vector<at::Tensor>& blocks, const at::Tensor& whole,
                     ReduceOp op, const WaitContext& ctx);
  // Data movement (tensors may be non-contiguous).
  void broadcast(const std::vector<at::Tensor>& tensors, int root, const WaitContext& ctx);
  void allgather(const std::vector<at::Tensor>& outputs, const at::Tensor& input, const WaitContext& ctx);
  void gather(const std::vector<at::Tensor>& outputs, const at::Tensor& input, int root, const WaitContext& ctx);
  void scatter(const at::Tensor& output, const std::vector<at::Tensor>& inputs, int root, const WaitContext& ctx);
  // Byte splits per peer of the (contiguous-staged) input and output.
  void alltoallBytes(const at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& outBytes,
                     const std::vector<int64_t>& inBytes, const WaitContext& ctx);
  void alltoall(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                const WaitContext& ctx);
  void barrier(const WaitContext& ctx);
  // Asynchronous p2p through Gloo; the Work writes non-contiguous receives back on wait().
  c10::intrusive_ptr<c10d::Work> send(const at::Tensor& tensor, int dst, int tag);
  c10::intrusive_ptr<c10d::Work> recv(const at::Tensor& tensor, int src, int tag);  // src -1: any

 private:
  tuning::Plan plan(tuning::Op op, uint64_t bytes, DataType dtype = DataType::kBytes,
                    ReduceOp redop = ReduceOp::kSum, bool equalBlocks = true) const;
  uint64_t chunkFloor() const;

  Link link_;
  MismatchCheck check_;
  tuning::Knobs knobs_;
  tuning::Group group_;
};

}  // namespace tdx
