// TdxBackend's collective overrides: validate at the call site, then hand a body to the queue.
// Bodies capture Staged tensors (contiguous views or copies written back on success).
#include <c10/util/Exception.h>

#include "backend/cuda_staging.h"
#include "backend/tdx_backend.h"
#include "backend/tensor_utils.h"
#include "collectives/collectives.h"
#include "common/env.h"

namespace tdx {

namespace {

// Holds staged tensors alive for the body and writes them back after it.
struct StagedSet {
  std::vector<Staged> items;
  void finish() { finishAll(items); }
};

void checkSameNumel(const char* op, const at::Tensor& ref, const at::Tensor& t, const char* what, size_t idx) {
  TORCH_CHECK_VALUE(t.numel() == ref.numel(), "tdx: ", op, ": ", what, "[", idx, "] has ", t.numel(),
                    " elements but the input has ", ref.numel(), "; every tensor must have the same number of "
                    "elements");
}

std::vector<at::Tensor> tensorsOf(const std::vector<Staged>& items) {
  std::vector<at::Tensor> ts;
  ts.reserve(items.size());
  for (const auto& s : items) ts.push_back(s.tensor());
  return ts;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> TdxBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceOptions& opts) {
  if (auto dev = cudaDeviceOf("all_reduce", tensors)) return cudaAllreduce(*dev, tensors, opts);
  checkNonEmptyList("all_reduce", tensors, "tensors");
  checkTensors("all_reduce", tensors);
  TORCH_CHECK(!opts.sparseIndices.has_value(), "tdx: all_reduce of sparse tensors is not supported; use gloo");
  // PREMUL_SUM (what our DDP uses to fold 1/world_size into the reduction): SUM of scale * x.
  const bool premul = opts.reduceOp.op_ == c10d::ReduceOp::PREMUL_SUM;
  const double scale = premul ? premulFactor("all_reduce", opts.reduceOp, tensors[0].scalar_type()) : 1.0;
  const ReduceOp op = premul ? ReduceOp::kSum : toReduceOp("all_reduce", opts.reduceOp, tensors[0].scalar_type());
  std::vector<at::Tensor> reducible;
  for (auto& t : tensors) reducible.push_back(asReducible(t));
  const DataType dt = reduceDtype("all_reduce", reducible[0].scalar_type());
  auto staged = std::make_shared<StagedSet>(StagedSet{stageAll(reducible)});
  return enqueue(c10d::OpType::ALLREDUCE, "all_reduce", tensors, isAsyncOp(opts),
                 [this, staged, op, dt, scale](const WaitContext& ctx) {
                   AllreduceOptions o;
                   o.in = o.out = spanList(staged->items);
                   o.dtype = dt;
                   o.op = op;
                   o.scale = scale;
                   o.oneshotBytes = env().oneshotBytes;
                   if (hier_) {
                     std::vector<at::Tensor> ts = tensorsOf(staged->items);
                     if (scale != 1.0) {
                       for (auto& t : ts) t.mul_(scale);  // same bits as the fused scale
                     }
                     hier_->allreduce(*group_, ts, op, ctx);
                   } else {
                     tdx::allreduce(*group_, o, ctx);
                   }
                   staged->finish();
                 });
}

c10::intrusive_ptr<c10d::Work> TdxBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                               const c10d::AllreduceCoalescedOptions& opts) {
  return allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> TdxBackend::reduce(std::vector<at::Tensor>& tensors,
                                                  const c10d::ReduceOptions& opts) {
  if (auto dev = cudaDeviceOf("reduce", tensors)) return cudaReduce(*dev, tensors, opts);
  checkNonEmptyList("reduce", tensors, "tensors");
  checkTensors("reduce", tensors);
  checkRoot("reduce", opts.rootRank);
  const ReduceOp op = toReduceOp("reduce", opts.reduceOp, tensors[0].scalar_type());
  std::vector<at::Tensor> reducible;
  for (auto& t : tensors) reducible.push_back(asReducible(t));
  const DataType dt = reduceDtype("reduce", reducible[0].scalar_type());
  auto staged = std::make_shared<StagedSet>(StagedSet{stageAll(reducible)});
  const int root = static_cast<int>(opts.rootRank);
  return enqueue(c10d::OpType::REDUCE, "reduce", tensors, isAsyncOp(opts),
                 [this, staged, op, dt, root](const WaitContext& ctx) {
                   if (hier_) {  // all-reduce; non-roots reduce copies and keep their tensors
                     std::vector<at::Tensor> ts = tensorsOf(staged->items);
                     if (rank_ != root) {
                       for (auto& t : ts) t = t.clone();
                     }
                     hier_->allreduce(*group_, ts, op, ctx, root);
                     if (rank_ == root) staged->finish();
                     return;
                   }
                   AllreduceOptions o;
                   o.in = o.out = spanList(staged->items);
                   o.dtype = dt;
                   o.op = op;
                   o.root = root;
                   o.oneshotBytes = env().oneshotBytes;
                   tdx::allreduce(*group_, o, ctx);
                   if (group_->rank() == root) staged->finish();
                 });
}

c10::intrusive_ptr<c10d::Work> TdxBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                     const c10d::BroadcastOptions& opts) {
  if (auto dev = cudaDeviceOf("broadcast", tensors)) return cudaBroadcast(*dev, tensors, opts);
  checkNonEmptyList("broadcast", tensors, "tensors");
  checkTensors("broadcast", tensors);
  checkRoot("broadcast", opts.rootRank);
  TORCH_CHECK_VALUE(opts.rootTensor == 0, "tdx: broadcast: rootTensor must be 0, got ", opts.rootTensor);
  const int root = static_cast<int>(opts.rootRank);
  if (hier_) {
    return enqueue(c10d::OpType::BROADCAST, "broadcast", tensors, isAsyncOp(opts),
                   [this, tensors, root](const WaitContext& ctx) { hier_->broadcast(tensors, root, ctx); });
  }
  auto staged = std::make_shared<StagedSet>(StagedSet{stageAll(tensors, /*copyIn=*/rank_ == root)});
  return enqueue(c10d::OpType::BROADCAST, "broadcast", tensors, isAsyncOp(opts),
                 [this, staged, root](const WaitContext& ctx) {
                   BroadcastOptions o;
                   o.data = spanList(staged->items);
                   o.root = root;
                   tdx::broadcast(*group_, o, ctx);
                   if (group_->rank() != root) staged->finish();
                 });
}

c10::intrusive_ptr<c10d::Work> TdxBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) {
  TORCH_CHECK_VALUE(inputs.size() == 1 && outputs.size() == 1, "tdx: all_gather takes one input tensor and one "
                    "output list, got ", inputs.size(), " and ", outputs.size());
  return allgatherByInput(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> TdxBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputLists,
                                                               std::vector<at::Tensor>& inputs,
                                                               const c10d::AllgatherOptions& opts) {
  // torch's layout (gloo's): outputLists[p][i] receives inputs[i] of rank p.
  checkNonEmptyList("all_gather_coalesced", inputs, "input tensors");
  TORCH_CHECK_VALUE(static_cast<int>(outputLists.size()) == size_, "tdx: all_gather_coalesced: got ",
                    outputLists.size(), " output lists but the group has ", size_,
                    " ranks; pass one list per rank, each with one tensor per input");
  std::vector<std::vector<at::Tensor>> byInput(inputs.size());
  for (int p = 0; p < size_; ++p) {
    TORCH_CHECK_VALUE(outputLists[p].size() == inputs.size(), "tdx: all_gather_coalesced: output list ", p, " has ",
                      outputLists[p].size(), " tensors for ", inputs.size(), " inputs; pass one tensor per input");
    for (size_t i = 0; i < inputs.size(); ++i) byInput[i].push_back(outputLists[p][i]);
  }
  return allgatherByInput(byInput, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> TdxBackend::allgatherByInput(std::vector<std::vector<at::Tensor>>& outputLists,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::AllgatherOptions& opts) {
  // outputLists[i] holds world-size tensors receiving inputs[i] of every rank.
  {
    std::vector<std::vector<at::Tensor>> all = outputLists;
    all.push_back(inputs);
    if (auto dev = cudaDeviceOf("all_gather", all)) return cudaAllgather(*dev, outputLists, inputs, opts);
  }
  checkNonEmptyList("all_gather", inputs, "input tensors");
  TORCH_CHECK_VALUE(outputLists.size() == inputs.size(), "tdx: all_gather: got ", outputLists.size(),
                    " output lists for ", inputs.size(), " inputs; pass one list per input");
  std::vector<at::Tensor> flatOutputs;
  auto ins = std::make_shared<StagedSet>();
  auto outs = std::make_shared<std::vector<StagedSet>>();
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkTensor("all_gather", inputs[i], "input");
    TORCH_CHECK_VALUE(static_cast<int>(outputLists[i].size()) == size_, "tdx: all_gather: output list has ",
                      outputLists[i].size(), " tensors but the group has ", size_,
                      " ranks; pass one output tensor per rank");
    for (size_t p = 0; p < outputLists[i].size(); ++p) {
      checkTensor("all_gather", outputLists[i][p], "output");
      checkSameDtype("all_gather", inputs[i], outputLists[i][p], "input and output tensors");
    }
    checkSameNumel("all_gather", inputs[i], outputLists[i][rank_], "output", rank_);
    ins->items.emplace_back(inputs[i]);
    outs->push_back(StagedSet{stageAll(outputLists[i], /*copyIn=*/false)});
    flatOutputs.insert(flatOutputs.end(), outputLists[i].begin(), outputLists[i].end());
  }
  return enqueue(c10d::OpType::ALLGATHER, "all_gather", flatOutputs, isAsyncOp(opts),
                 [this, ins, outs](const WaitContext& ctx) {
                   for (size_t i = 0; i < ins->items.size(); ++i) {
                     if (hier_) {
                       hier_->allgather(tensorsOf((*outs)[i].items), ins->items[i].tensor(), ctx);
                     } else {
                       AllgatherOptions o;
                       o.in = ins->items[i].span();
                       o.out = spans((*outs)[i].items);
                       tdx::allgather(*group_, o, ctx);
                     }
                     (*outs)[i].finish();
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> TdxBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                           const c10d::AllgatherOptions& opts) {
  std::vector<at::Tensor> outputs{output}, inputs{input};
  return allgather_into_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> TdxBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                           std::vector<at::Tensor>& inputs,
                                                                           const c10d::AllgatherOptions& opts) {
  if (auto dev = cudaDeviceOf("all_gather_into_tensor", {inputs, outputs})) {
    return cudaAllgatherInto(*dev, outputs, inputs, opts);
  }
  checkFlatPairs("all_gather_into_tensor", outputs, inputs, size_, /*outputIsLarge=*/true, /*inputsShareDtype=*/false,
                 checkTensor);
  auto ins = std::make_shared<StagedSet>();
  auto outs = std::make_shared<StagedSet>();
  for (size_t i = 0; i < inputs.size(); ++i) {
    ins->items.emplace_back(inputs[i]);
    outs->items.emplace_back(outputs[i], /*copyIn=*/false);
  }
  return enqueue(c10d::OpType::_ALLGATHER_BASE, "all_gather_into_tensor", outputs, isAsyncOp(opts),
                 [this, ins, outs](const WaitContext& ctx) {
                   for (size_t i = 0; hier_ && i < ins->items.size(); ++i) {
                     const int64_t n = ins->items[i].tensor().numel();
                     at::Tensor flat = outs->items[i].tensor().reshape({-1});
                     std::vector<at::Tensor> views;
                     for (int p = 0; p < size_; ++p) views.push_back(flat.narrow(0, p * n, n));
                     hier_->allgather(views, ins->items[i].tensor(), ctx);
                   }
                   for (size_t i = 0; !hier_ && i < ins->items.size(); ++i) {
                     const size_t block = ins->items[i].bytes();
                     AllgatherOptions o;
                     o.in = ins->items[i].span();
                     for (int p = 0; p < group_->size(); ++p) {
                       o.out.push_back(Span{static_cast<char*>(outs->items[i].data()) + p * block, block});
                     }
                     tdx::allgather(*group_, o, ctx);
                   }
                   outs->finish();
                 });
}

c10::intrusive_ptr<c10d::Work> TdxBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                  std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  {
    std::vector<std::vector<at::Tensor>> all = outputs;
    all.push_back(inputs);
    if (auto dev = cudaDeviceOf("gather", all)) return cudaGather(*dev, outputs, inputs, opts);
  }
  checkRoot("gather", opts.rootRank);
  TORCH_CHECK_VALUE(inputs.size() == 1, "tdx: gather takes one input tensor, got ", inputs.size());
  checkTensor("gather", inputs[0], "input");
  const int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> outList =
      rootTensorList("gather", "gather_list", "input", outputs, inputs[0], rank_, root, size_, checkTensor);
  auto outs = std::make_shared<StagedSet>();
  if (!outList.empty()) outs->items = stageAll(outList, /*copyIn=*/false);
  auto in = std::make_shared<Staged>(inputs[0]);
  return enqueue(c10d::OpType::GATHER, "gather", outList, isAsyncOp(opts),
                 [this, in, outs, root](const WaitContext& ctx) {
                   if (hier_) {
                     hier_->gather(tensorsOf(outs->items), in->tensor(), root, ctx);
                     outs->finish();
                     return;
                   }
                   AllgatherOptions o;
                   o.in = in->span();
                   o.out = spans(outs->items);
                   o.root = root;
                   tdx::allgather(*group_, o, ctx);
                   outs->finish();
                 });
}

c10::intrusive_ptr<c10d::Work> TdxBackend::scatter(std::vector<at::Tensor>& outputs,
                                                   std::vector<std::vector<at::Tensor>>& inputs,
                                                   const c10d::ScatterOptions& opts) {
  {
    std::vector<std::vector<at::Tensor>> all = inputs;
    all.push_back(outputs);
    if (auto dev = cudaDeviceOf("scatter", all)) return cudaScatter(*dev, outputs, inputs, opts);
  }
  checkRoot("scatter", opts.rootRank);
  TORCH_CHECK_VALUE(outputs.size() == 1, "tdx: scatter takes one output tensor, got ", outputs.size());
  checkTensor("scatter", outputs[0], "output");
  const int root = static_cast<int>(opts.rootRank);
  const std::vector<at::Tensor> inList =
      rootTensorList("scatter", "scatter_list", "output", inputs, outputs[0], rank_, root, size_, checkTensor);
  auto ins = std::make_shared<StagedSet>();
  if (!inList.empty()) ins->items = stageAll(inList);
  auto out = std::make_shared<Staged>(outputs[0], /*copyIn=*/false);
  return enqueue(c10d::OpType::SCATTER, "scatter", outputs, isAsyncOp(opts),
                 [this, ins, out, root](const WaitContext& ctx) {
                   if (hier_) {
                     hier_->scatter(out->tensor(), tensorsOf(ins->items), root, ctx);
                     out->finish();
                     return;
                   }
                   ScatterOptions o;
                   o.in = spans(ins->items);
                   o.out = out->span();
                   o.root = root;
                   tdx::scatter(*group_, o, ctx);
                   out->finish();
                 });
}

c10::intrusive_ptr<c10d::Work> TdxBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                          std::vector<std::vector<at::Tensor>>& inputs,
                                                          const c10d::ReduceScatterOptions& opts) {
  {
    std::vector<std::vector<at::Tensor>> all = inputs;
    all.push_back(outputs);
    if (auto dev = cudaDeviceOf("reduce_scatter", all)) return cudaReduceScatter(*dev, outputs, inputs, opts);
  }
  TORCH_CHECK_VALUE(outputs.size() == 1 && inputs.size() == 1, "tdx: reduce_scatter takes one output and one input "
                    "list");
  checkTensor("reduce_scatter", outputs[0], "output");
  TORCH_CHECK_VALUE(static_cast<int>(inputs[0].size()) == size_, "tdx: reduce_scatter: input list has ",
                    inputs[0].size(), " tensors but the group has ", size_, " ranks; pass one per rank");
  for (size_t p = 0; p < inputs[0].size(); ++p) {
    checkTensor("reduce_scatter", inputs[0][p], "input");
    checkSameDtype("reduce_scatter", outputs[0], inputs[0][p], "output and input tensors");
    checkSameNumel("reduce_scatter", outputs[0], inputs[0][p], "input_list", p);
  }
  const ReduceOp op = toReduceOp("reduce_scatter", opts.reduceOp, outputs[0].scalar_type());
  std::vector<at::Tensor> reducibleIn;
  for (auto& t : inputs[0]) reducibleIn.push_back(asReducible(t));
  const DataType dt = reduceDtype("reduce_scatter", reducibleIn[0].scalar_type());
  auto ins = std::make_shared<StagedSet>(StagedSet{stageAll(reducibleIn)});
  auto out = std::make_shared<Staged>(asReducible(outputs[0]), /*copyIn=*/false);
  return enqueue(c10d::OpType::REDUCE_SCATTER, "reduce_scatter", outputs, isAsyncOp(opts),
                 [this, ins, out, op, dt](const WaitContext& ctx) {
                   if (hier_) {
                     std::vector<at::Tensor> flat;
                     for (const auto& s : ins->items) flat.push_back(s.tensor().reshape({-1}));
                     hier_->reduceScatter(*group_, out->tensor(), at::cat(flat), op, ctx);
                     out->finish();
                     return;
                   }
                   ReduceScatterOptions o;
                   o.in = spans(ins->items);
                   o.out = out->span();
                   o.dtype = dt;
                   o.op = op;
                   tdx::reduceScatter(*group_, o, ctx);
                   out->finish();
                 });
}

c10::intrusive_ptr<c10d::Work> TdxBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                const c10d::ReduceScatterOptions& opts) {
  std::vector<at::Tensor> outputs{output}, inputs{input};
  return reduce_scatter_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> TdxBackend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                           std::vector<at::Tensor>& inputs,
                                                                           const c10d::ReduceScatterOptions& opts) {
  if (auto dev = cudaDeviceOf("reduce_scatter_tensor", {inputs, outputs})) {
    return cudaReduceScatterTensor(*dev, outputs, inputs, opts);
  }
  checkFlatPairs("reduce_scatter_tensor", outputs, inputs, size_, /*outputIsLarge=*/false, /*inputsShareDtype=*/true,
                 checkTensor);
  const ReduceOp op = toReduceOp("reduce_scatter_tensor", opts.reduceOp, inputs[0].scalar_type());
  auto ins = std::make_shared<StagedSet>();
  auto outs = std::make_shared<StagedSet>();
  DataType dt = DataType::kFloat32;
  for (size_t i = 0; i < inputs.size(); ++i) {
    at::Tensor in = asReducible(inputs[i]);
    dt = reduceDtype("reduce_scatter_tensor", in.scalar_type());
    ins->items.emplace_back(in);
    outs->items.emplace_back(asReducible(outputs[i]), /*copyIn=*/false);
  }
  return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor", outputs, isAsyncOp(opts),
                 [this, ins, outs, op, dt](const WaitContext& ctx) {
                   for (size_t i = 0; hier_ && i < ins->items.size(); ++i) {
                     hier_->reduceScatter(*group_, outs->items[i].tensor(),
                                          ins->items[i].tensor().reshape({-1}).clone(), op, ctx);
                   }
                   for (size_t i = 0; !hier_ && i < ins->items.size(); ++i) {
                     const size_t block = outs->items[i].bytes();
                     ReduceScatterOptions o;
                     for (int p = 0; p < group_->size(); ++p) {
                       o.in.push_back(Span{static_cast<char*>(ins->items[i].data()) + p * block, block});
                     }
                     o.out = outs->items[i].span();
                     o.dtype = dt;
                     o.op = op;
                     tdx::reduceScatter(*group_, o, ctx);
                   }
                   outs->finish();
                 });
}

c10::intrusive_ptr<c10d::Work> TdxBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                         std::vector<int64_t>& outputSplitSizes,
                                                         std::vector<int64_t>& inputSplitSizes,
                                                         const c10d::AllToAllOptions& opts) {
  const char* name = "all_to_all_single";
  if (auto dev = cudaDeviceOf(name, std::vector<at::Tensor>{input, output})) {
    return cudaAlltoallBase(*dev, output, input, outputSplitSizes, inputSplitSizes, opts);
  }
  checkTensor(name, input, "input");
  checkTensor(name, output, "output");
  checkSameDtype(name, input, output, "input and output");
  auto blocks = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* what) {
    std::vector<int64_t> rows;
    const int64_t dim0 = t.dim() == 0 ? 1 : t.size(0);
    if (splits.empty()) {
      TORCH_CHECK_VALUE(dim0 % size_ == 0, "tdx: ", name, ": ", what, " has ", dim0,
                        " rows, not divisible by the world size ", size_, "; pass explicit split sizes");
      rows.assign(size_, dim0 / size_);
    } else {
      TORCH_CHECK_VALUE(static_cast<int>(splits.size()) == size_, "tdx: ", name, ": ", splits.size(), " ", what,
                        " split sizes for a group of ", size_, " ranks; pass one per rank");
      int64_t sum = 0;
      for (int64_t s : splits) {
        TORCH_CHECK_VALUE(s >= 0, "tdx: ", name, ": negative ", what, " split size ", s);
        sum += s;
      }
      TORCH_CHECK_VALUE(sum == dim0, "tdx: ", name, ": ", what, " split sizes sum to ", sum, " but the ", what,
                        " has ", dim0, " rows along dim 0");
      rows = splits;
    }
    return rows;
  };
  const auto inRows = blocks(input, inputSplitSizes, "input");
  const auto outRows = blocks(output, outputSplitSizes, "output");
  auto in = std::make_shared<Staged>(input);
  auto out = std::make_shared<Staged>(output, /*copyIn=*/false);
  const int64_t inRowBytes = input.dim() == 0 ? input.element_size() : input.numel() / std::max<int64_t>(1, input.size(0)) * input.element_size();
  const int64_t outRowBytes = output.dim() == 0 ? output.element_size() : output.numel() / std::max<int64_t>(1, output.size(0)) * output.element_size();
  return enqueue(c10d::OpType::ALLTOALL_BASE, name, {output}, isAsyncOp(opts),
                 [this, in, out, inRows, outRows, inRowBytes, outRowBytes](const WaitContext& ctx) {
                   if (hier_) {
                     std::vector<int64_t> ib, ob;
                     for (int p = 0; p < size_; ++p) {
                       ib.push_back(inRows[p] * inRowBytes);
                       ob.push_back(outRows[p] * outRowBytes);
                     }
                     hier_->alltoallBytes(out->tensor(), in->tensor(), ob, ib, ctx);
                     out->finish();
                     return;
                   }
                   AlltoallOptions o;
                   size_t ioff = 0, ooff = 0;
                   for (int p = 0; p < group_->size(); ++p) {
                     const size_t ib = inRows[p] * inRowBytes, ob = outRows[p] * outRowBytes;
                     o.in.push_back(Span{static_cast<char*>(in->data()) + ioff, ib});
                     o.out.push_back(Span{static_cast<char*>(out->data()) + ooff, ob});
                     ioff += ib;
                     ooff += ob;
                   }
                   tdx::alltoall(*group_, o, ctx);
                   out->finish();
                 });
}

c10::intrusive_ptr<c10d::Work> TdxBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                    std::vector<at::Tensor>& inputs,
                                                    const c10d::AllToAllOptions& opts) {
  const char* name = "all_to_all";
  if (auto dev = cudaDeviceOf(name, {inputs, outputs})) return cudaAlltoall(*dev, outputs, inputs, opts);
  TORCH_CHECK_VALUE(static_cast<int>(inputs.size()) == size_ && static_cast<int>(outputs.size()) == size_,
                    "tdx: ", name, ": got ", inputs.size(), " inputs and ", outputs.size(),
                    " outputs for a group of ", size_, " ranks; pass one of each per rank");
  checkTensors(name, inputs, "inputs");
  checkTensors(name, outputs, "outputs");
  checkSameDtype(name, inputs[0], outputs[0], "input and output tensors");
  auto ins = std::make_shared<StagedSet>(StagedSet{stageAll(inputs)});
  auto outs = std::make_shared<StagedSet>(StagedSet{stageAll(outputs, /*copyIn=*/false)});
  return enqueue(c10d::OpType::ALLTOALL, name, outputs, isAsyncOp(opts), [this, ins, outs](const WaitContext& ctx) {
    if (hier_) {
      hier_->alltoall(tensorsOf(outs->items), tensorsOf(ins->items), ctx);
      outs->finish();
      return;
    }
    AlltoallOptions o;
    o.in = spans(ins->items);
    o.out = spans(outs->items);
    tdx::alltoall(*group_, o, ctx);
    outs->finish();
  });
}

}  // namespace tdx
