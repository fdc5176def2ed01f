// The flat forms across hosts: one Gloo operation (or Gloo p2p) over all ranks of the group, on
// byte views of the tensors (so every dtype moves, including those Gloo cannot reduce); tensors
// may be non-contiguous (staged). The caller has checked the operation (mismatch_check.h), except
// where a function takes `check`, which runs while Gloo works.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <string>
#include <vector>

#include "multihost/link.h"
#include "tuning/plan.h"

namespace tdx {

// The Gloo p2p tags of the small broadcast's and the barrier's messages on the all-ranks group
// (user p2p may not use them).
inline constexpr int kBroadcastTag = 0x7ffffffe;
inline constexpr int kBarrierTag = 0x7ffffffd;

// broadcast: `how` kP2PFromRoot sends Gloo p2p from the root to every rank on the calling thread
// (what Gloo's broadcast sends, without its hand-off to a worker thread and back), kGlooAll runs
// Gloo's broadcast per tensor.
void flatBroadcast(Link& link, const std::vector<at::Tensor>& tensors, int root, tuning::LinkAlgo how,
                   const WaitContext& ctx, const std::function<void()>& check);
// all_gather: Gloo's (equal sizes), else each rank broadcasts its block in turn.
void flatAllgather(Link& link, const std::vector<at::Tensor>& outputs, const at::Tensor& input, const WaitContext& ctx);
void flatGather(Link& link, const std::vector<at::Tensor>& outputs, const at::Tensor& input, int root,
                const WaitContext& ctx);
void flatScatter(Link& link, const at::Tensor& output, const std::vector<at::Tensor>& inputs, int root,
                 const WaitContext& ctx);
// Byte splits per peer of the (contiguous-staged) input and output.
void flatAlltoallBytes(Link& link, const at::Tensor& output, const at::Tensor& input,
                       const std::vector<int64_t>& outBytes, const std::vector<int64_t>& inBytes,
                       const WaitContext& ctx);
// reduce_scatter as Gloo's reduce_scatter (for the dtypes and ops Gloo takes). `whole`, when
// defined, is one contiguous tensor holding the blocks back to back.
void flatReduceScatter(Link& link, const at::Tensor& output, const std::vector<at::Tensor>& blocks,
                       const at::Tensor& whole, ReduceOp op, const WaitContext& ctx);
// barrier once this host's ranks are all here: the host's first rank tells every other host's
// first rank and hears from each (Gloo p2p); its host mates wait for it in shared memory.
void flatBarrier(Link& link, const WaitContext& ctx);

// Asynchronous p2p through Gloo on the all-ranks group; a receive into a non-contiguous tensor is
// written back on wait(). `src` -1: any source.
GlooWork glooSend(Link& link, const at::Tensor& tensor, int dst, int tag);
GlooWork glooRecv(Link& link, const at::Tensor& tensor, int src, int tag);

}  // namespace tdx
