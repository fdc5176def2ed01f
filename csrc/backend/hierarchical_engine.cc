// The hierarchical engine: a group spanning hosts. Each call stages its tensors (contiguous views
// or copies written back) and runs the matching Hierarchy operation (csrc/multihost) on the
// progress queue; point-to-point goes through Gloo directly.
#include <c10/util/Exception.h>

#include "backend/host_engine.h"
#include "backend/tensor_utils.h"

namespace tdx {

namespace {

// `count` views of `block` elements each, back to back in a contiguous tensor.
Tensors blockViews(const at::Tensor& t, int64_t block, int count) {
  at::Tensor flat = t.reshape({-1});
  Tensors views;
  for (int p = 0; p < count; ++p) views.push_back(flat.narrow(0, p * block, block));
  return views;
}

}  // namespace

HierarchicalEngine::HierarchicalEngine(std::unique_ptr<shm::ShmGroup> group, CrossHost x, int rank, int size)
    : HostEngine(std::move(group), rank), hier_(std::make_unique<Hierarchy>(*group_, rank, size, std::move(x))),
      size_(size) {
  postFinished_ = true;
}

WorkPtr HierarchicalEngine::allreduce(ReduceArgs a, const OpContext& c) {
  auto staged = stagedSet(a.tensors);
  return run(c, [this, staged, a = std::move(a)](const WaitContext& ctx) {
    Tensors ts = staged->tensors();
    // Non-roots of a reduce keep their tensors: scaled into copies, else kept by the Hierarchy.
    const bool nonRoot = a.root >= 0 && rank_ != a.root;
    for (auto& t : ts) {
      if (a.scale != 1.0) t = nonRoot ? t.mul(a.scale) : t.mul_(a.scale);  // same bits as the fused scale
    }
    hier_->allreduce(ts, a.op, ctx, a.root, /*keepInputs=*/nonRoot && a.scale == 1.0);
    if (!nonRoot) staged->finish();
  });
}

WorkPtr HierarchicalEngine::broadcast(BroadcastArgs a, const OpContext& c) {
  return run(c, [this, a = std::move(a)](const WaitContext& ctx) { hier_->broadcast(a.tensors, a.root, ctx); });
}

WorkPtr HierarchicalEngine::allgather(AllgatherArgs a, const OpContext& c) {
  return runPerInput(c, a, [this](const Staged& in, const StagedSet& outs, const WaitContext& ctx) {
    hier_->allgather(outs.tensors(), in.tensor(), ctx);
  });
}

WorkPtr HierarchicalEngine::allgatherFlat(FlatArgs a, const OpContext& c) {
  return runStaged(c, a.inputs, a.outputs, [this](const StagedSet& in, const StagedSet& out, const WaitContext& ctx) {
    for (size_t i = 0; i < in.items.size(); ++i) {
      const at::Tensor& x = in.items[i].tensor();
      hier_->allgather(blockViews(out.items[i].tensor(), x.numel(), size_), x, ctx);
    }
  });
}

WorkPtr HierarchicalEngine::gather(RootedArgs a, const OpContext& c) {
  return runStaged(c, a.inputs, a.outputs,
                   [this, root = a.root](const StagedSet& in, const StagedSet& out, const WaitContext& ctx) {
                     hier_->gather(out.tensors(), in.items[0].tensor(), root, ctx);
                   });
}

WorkPtr HierarchicalEngine::scatter(RootedArgs a, const OpContext& c) {
  return runStaged(c, a.inputs, a.outputs,
                   [this, root = a.root](const StagedSet& in, const StagedSet& out, const WaitContext& ctx) {
                     hier_->scatter(out.items[0].tensor(), in.tensors(), root, ctx);
                   });
}

WorkPtr HierarchicalEngine::reduceScatter(ReduceScatterArgs a, const OpContext& c) {
  return runStaged(c, a.inputs, {a.output},
                   [this, op = a.op](const StagedSet& in, const StagedSet& out, const WaitContext& ctx) {
                     Tensors blocks;
                     for (const auto& s : in.items) blocks.push_back(s.tensor().reshape({-1}));
                     hier_->reduceScatter(out.items[0].tensor(), blocks, at::Tensor(), op, ctx);
                   });
}

WorkPtr HierarchicalEngine::reduceScatterFlat(FlatArgs a, const OpContext& c) {
  return runStaged(c, a.inputs, a.outputs,
                   [this, op = a.op](const StagedSet& in, const StagedSet& out, const WaitContext& ctx) {
                     for (size_t i = 0; i < in.items.size(); ++i) {
                       at::Tensor whole = in.items[i].tensor().reshape({-1});
                       const int64_t m = out.items[i].tensor().numel();
                       hier_->reduceScatter(out.items[i].tensor(), blockViews(whole, m, size_), whole, op,
                                            ctx);
                     }
                   });
}

WorkPtr HierarchicalEngine::alltoall(AlltoallArgs a, const OpContext& c) {
  return runStaged(c, a.inputs, a.outputs, [this, a](const StagedSet& in, const StagedSet& out, const WaitContext& ctx) {
    if (a.single) {
      hier_->alltoallBytes(out.items[0].tensor(), in.items[0].tensor(), a.outBytes, a.inBytes, ctx);
    } else {
      hier_->alltoall(out.tensors(), in.tensors(), ctx);
    }
  });
}

WorkPtr HierarchicalEngine::send(P2PArgs a, const OpContext&) { return hier_->send(a.tensor, a.peer, a.tag); }
WorkPtr HierarchicalEngine::recv(P2PArgs a, const OpContext&) { return hier_->recv(a.tensor, a.peer, a.tag); }

WorkPtr HierarchicalEngine::barrier(const OpContext& c) {
  return run(c, [this](const WaitContext& ctx) { hier_->barrier(ctx); });
}

}  // namespace tdx
