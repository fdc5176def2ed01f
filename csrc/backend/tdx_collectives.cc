// TdxBackend's collective overrides: validate at the call site, pick the call's engine, hand it the
// validated arguments. One shape for every override; the engines hold the data paths.
#include <c10/util/Exception.h>

#include "backend/host_engine.h"
#include "backend/tdx_backend.h"
#include "backend/tensor_utils.h"

namespace tdx {

namespace {

void checkSameNumel(const char* op, const at::Tensor& ref, const at::Tensor& t, const char* what, size_t idx) {
  TORCH_CHECK_VALUE(t.numel() == ref.numel(), "tdx: ", op, ": ", what, "[", idx, "] has ", t.numel(),
                    " elements but the input has ", ref.numel(), "; every tensor must have the same number of "
                    "elements");
}

Tensors reducibleOf(const Tensors& ts) {
  Tensors r;
  for (const auto& t : ts) r.push_back(asReducible(t));
  return r;
}

// The byte size of each rank's block of `t` along dim 0 (all_to_all_single's split sizes).
std::vector<int64_t> splitBytes(const char* op, const at::Tensor& t, const std::vector<int64_t>& splits,
                                const char* what, int size) {
  const int64_t dim0 = t.dim() == 0 ? 1 : t.size(0);
  const int64_t rowBytes = dim0 == 0 ? 0 : static_cast<int64_t>(t.nbytes()) / dim0;
  std::vector<int64_t> rows;
  if (splits.empty()) {
    TORCH_CHECK_VALUE(dim0 % size == 0, "tdx: ", op, ": ", what, " has ", dim0, " rows, not divisible by the world "
                      "size ", size, "; pass explicit split sizes");
    rows.assign(size, dim0 / size);
  } else {
    TORCH_CHECK_VALUE(static_cast<int>(splits.size()) == size, "tdx: ", op, ": ", splits.size(), " ", what,
                      " split sizes for a group of ", size, " ranks; pass one per rank");
    int64_t sum = 0;
    for (int64_t s : splits) {
      TORCH_CHECK_VALUE(s >= 0, "tdx: ", op, ": negative ", what, " split size ", s);
      sum += s;
    }
    TORCH_CHECK_VALUE(sum == dim0, "tdx: ", op, ": ", what, " split sizes sum to ", sum, " but the ", what, " has ",
                      dim0, " rows along dim 0");
    rows = splits;
  }
  for (auto& r : rows) r *= rowBytes;
  return rows;
}

// The device of an all_gather_into_tensor (`outputIsLarge`) or reduce_scatter_tensor call, whose
// (output, input) pairs are checked (reduce_scatter_tensor's inputs share one dtype).
std::optional<at::Device> flatPairsDevice(const char* op, const Tensors& outputs, const Tensors& inputs, int size,
                                          bool outputIsLarge) {
  const auto dev = cudaDeviceOf(op, inputs, outputs);
  checkFlatPairs(op, outputs, inputs, size, outputIsLarge, /*inputsShareDtype=*/!outputIsLarge,
                 dev ? checkDeviceTensor : checkTensor);
  return dev;
}

// Every tensor of a call: the lists and one more list.
std::vector<Tensors> withList(std::vector<Tensors> lists, const Tensors& more) {
  lists.push_back(more);
  return lists;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> TdxBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceOptions& opts) {
  return allreduceCall(tensors, opts, /*wantsWork=*/true);
}

void TdxBackend::allreduceNow(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  allreduceCall(tensors, opts, /*wantsWork=*/false);
}

c10::intrusive_ptr<c10d::Work> TdxBackend::allreduceCall(std::vector<at::Tensor>& tensors,
                                                         const c10d::AllreduceOptions& opts, bool wantsWork) {
  const char* name = "all_reduce";
  std::optional<at::Device> dev;
  ReduceArgs a;
  refusable(name, [&] {
    dev = cudaDeviceOf(name, tensors);
    checkNonEmptyList(name, tensors, "tensors");
    checkTensors(name, tensors, "tensors", dev ? checkDeviceTensor : checkTensor);
    TORCH_CHECK(!opts.sparseIndices.has_value(), "tdx: all_reduce of sparse tensors is not supported; use gloo");
    // PREMUL_SUM (what our DDP uses to fold 1/world_size into the reduction): SUM of scale * x.
    const bool premul = !dev && opts.reduceOp.op_ == c10d::ReduceOp::PREMUL_SUM;
    a.scale = premul ? premulFactor(name, opts.reduceOp, tensors[0].scalar_type()) : 1.0;
    a.op = premul ? ReduceOp::kSum : toReduceOp(name, opts.reduceOp, tensors[0].scalar_type());
    a.tensors = reducibleOf(tensors);
    a.dtype = reduceDtype(name, a.tensors[0].scalar_type());
  });
  Engine& engine = route(name, dev, std::make_pair(a.dtype, a.op));
  const Issued c = context(name, c10d::OpType::ALLREDUCE, tensors, isAsyncOp(opts) && wantsWork, /*p2p=*/false, {},
                           -1, wantsWork);
  return issue(c, [&] { return engine.allreduce(std::move(a), c.op); });
}

c10::intrusive_ptr<c10d::Work> TdxBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                               const c10d::AllreduceCoalescedOptions& opts) {
  return allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> TdxBackend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  const char* name = "reduce";
  std::optional<at::Device> dev;
  ReduceArgs a;
  refusable(name, [&] {
    dev = cudaDeviceOf(name, tensors);
    checkNonEmptyList(name, tensors, "tensors");
    checkTensors(name, tensors, "tensors", dev ? checkDeviceTensor : checkTensor);
    checkRoot(name, opts.rootRank);
    a.op = toReduceOp(name, opts.reduceOp, tensors[0].scalar_type());
    a.tensors = reducibleOf(tensors);
    a.dtype = reduceDtype(name, a.tensors[0].scalar_type());
    a.root = static_cast<int>(opts.rootRank);
  });
  Engine& engine = route(name, dev, std::make_pair(a.dtype, a.op));
  const Issued c = context(name, c10d::OpType::REDUCE, tensors, isAsyncOp(opts));
  return track(engine.allreduce(std::move(a), c.op), c.record);
}

c10::intrusive_ptr<c10d::Work> TdxBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                     const c10d::BroadcastOptions& opts) {
  const char* name = "broadcast";
  std::optional<at::Device> dev;
  refusable(name, [&] {
    dev = cudaDeviceOf(name, tensors);
    checkNonEmptyList(name, tensors, "tensors");
    checkTensors(name, tensors, "tensors", dev ? checkDeviceTensor : checkTensor);
    checkRoot(name, opts.rootRank);
    TORCH_CHECK_VALUE(opts.rootTensor == 0, "tdx: broadcast: rootTensor must be 0, got ", opts.rootTensor);
  });
  Engine& engine = route(name, dev);
  BroadcastArgs a{tensors, static_cast<int>(opts.rootRank)};
  const Issued c = context(name, c10d::OpType::BROADCAST, tensors, isAsyncOp(opts));
  return track(engine.broadcast(std::move(a), c.op), c.record);
}

c10::intrusive_ptr<c10d::Work> TdxBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) {
  refusable("all_gather", [&] {
    TORCH_CHECK_VALUE(inputs.size() == 1 && outputs.size() == 1, "tdx: all_gather takes one input tensor and one "
                      "output list, got ", inputs.size(), " and ", outputs.size());
  });
  return allgatherByInput(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> TdxBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputLists,
                                                               std::vector<at::Tensor>& inputs,
                                                               const c10d::AllgatherOptions& opts) {
  // torch's layout (gloo's): outputLists[p][i] receives inputs[i] of rank p.
  std::vector<std::vector<at::Tensor>> byInput(inputs.size());
  refusable("all_gather_coalesced", [&] {
    checkNonEmptyList("all_gather_coalesced", inputs, "input tensors");
    TORCH_CHECK_VALUE(static_cast<int>(outputLists.size()) == size_, "tdx: all_gather_coalesced: got ",
                      outputLists.size(), " output lists but the group has ", size_,
                      " ranks; pass one list per rank, each with one tensor per input");
    for (int p = 0; p < size_; ++p) {
      TORCH_CHECK_VALUE(outputLists[p].size() == inputs.size(), "tdx: all_gather_coalesced: output list ", p,
                        " has ", outputLists[p].size(), " tensors for ", inputs.size(),
                        " inputs; pass one tensor per input");
      for (size_t i = 0; i < inputs.size(); ++i) byInput[i].push_back(outputLists[p][i]);
    }
  });
  return allgatherByInput(byInput, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> TdxBackend::allgatherByInput(std::vector<std::vector<at::Tensor>>& outputLists,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::AllgatherOptions& opts) {
  const char* name = "all_gather";
  std::optional<at::Device> dev;
  Tensors flatOutputs;
  refusable(name, [&] {
    dev = cudaDeviceOf(name, withList(outputLists, inputs));
    const TensorCheck check = dev ? checkDeviceTensor : checkTensor;
    checkNonEmptyList(name, inputs, "input tensors");
    TORCH_CHECK_VALUE(outputLists.size() == inputs.size(), "tdx: all_gather: got ", outputLists.size(),
                      " output lists for ", inputs.size(), " inputs; pass one list per input");
    for (size_t i = 0; i < inputs.size(); ++i) {
      check(name, inputs[i], "input");
      TORCH_CHECK_VALUE(static_cast<int>(outputLists[i].size()) == size_, "tdx: all_gather: output list has ",
                        outputLists[i].size(), " tensors but the group has ", size_,
                        " ranks; pass one output tensor per rank");
      for (size_t p = 0; p < outputLists[i].size(); ++p) {
        check(name, outputLists[i][p], "output");
        checkSameDtype(name, inputs[i], outputLists[i][p], "input and output tensors");
        if (dev) checkSameNumel(name, inputs[i], outputLists[i][p], "output", p);  // NCCL: equal blocks
      }
      checkSameNumel(name, inputs[i], outputLists[i][rank_], "output", rank_);
      flatOutputs.insert(flatOutputs.end(), outputLists[i].begin(), outputLists[i].end());
    }
  });
  Engine& engine = route(name, dev);
  AllgatherArgs a{outputLists, inputs};
  const Issued c = context(name, c10d::OpType::ALLGATHER, flatOutputs, isAsyncOp(opts), /*p2p=*/false, inputs);
  return track(engine.allgather(std::move(a), c.op), c.record);
}

c10::intrusive_ptr<c10d::Work> TdxBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                           const c10d::AllgatherOptions& opts) {
  std::vector<at::Tensor> outputs{output}, inputs{input};
  return allgather_into_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> TdxBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                           std::vector<at::Tensor>& inputs,
                                                                           const c10d::AllgatherOptions& opts) {
  return allgatherFlatCall(FlatArgs{outputs, inputs}, opts, /*wantsWork=*/true);
}

void TdxBackend::allgatherIntoTensorNow(at::Tensor& output, at::Tensor& input) {
  allgatherFlatCall(FlatArgs{{output}, {input}}, c10d::AllgatherOptions(), /*wantsWork=*/false);
}

c10::intrusive_ptr<c10d::Work> TdxBackend::allgatherFlatCall(FlatArgs a, const c10d::AllgatherOptions& opts,
                                                             bool wantsWork) {
  const char* name = "all_gather_into_tensor";
  std::optional<at::Device> dev;
  refusable(name, [&] { dev = flatPairsDevice(name, a.outputs, a.inputs, size_, /*outputIsLarge=*/true); });
  Engine& engine = route(name, dev);
  const Issued c = context(name, c10d::OpType::_ALLGATHER_BASE, a.outputs, isAsyncOp(opts) && wantsWork,
                           /*p2p=*/false, a.inputs, -1, wantsWork);
  return issue(c, [&] { return engine.allgatherFlat(std::move(a), c.op); });
}

void TdxBackend::postRefusal(const char* op, const std::exception& e) {
  if (size_ == 1) return;
  WaitContext w;
  w.op = op;
  w.seq = collSeq_ + 1;
  const auto* ce = dynamic_cast<const c10::Error*>(&e);
  if (routes_->host().postRefusal(w, ce ? ce->what_without_backtrace() : e.what())) ++collSeq_;
}

Tensors TdxBackend::rootedArgs(const char* op, const std::vector<Tensors>& lists, const Tensors& one,
                               const char* oneName, const char* listName, int64_t root,
                               std::optional<at::Device>& dev) {
  Tensors list;
  refusable(op, [&] {
    dev = cudaDeviceOf(op, withList(lists, one));
    const TensorCheck check = dev ? checkDeviceTensor : checkTensor;
    checkRoot(op, root);
    TORCH_CHECK_VALUE(one.size() == 1, "tdx: ", op, " takes one ", oneName, " tensor, got ", one.size());
    check(op, one[0], oneName);
    list = rootTensorList(op, listName, oneName, lists, one[0], rank_, static_cast<int>(root), size_, check);
  });
  return list;
}

c10::intrusive_ptr<c10d::Work> TdxBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                  std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  const char* name = "gather";
  std::optional<at::Device> dev;
  Tensors outList = rootedArgs(name, outputs, inputs, "input", "gather_list", opts.rootRank, dev);
  Engine& engine = route(name, dev);
  RootedArgs a{outList, {inputs[0]}, static_cast<int>(opts.rootRank)};
  const Issued c = context(name, c10d::OpType::GATHER, outList, isAsyncOp(opts), /*p2p=*/false, inputs);
  return track(engine.gather(std::move(a), c.op), c.record);
}

c10::intrusive_ptr<c10d::Work> TdxBackend::scatter(std::vector<at::Tensor>& outputs,
                                                   std::vector<std::vector<at::Tensor>>& inputs,
                                                   const c10d::ScatterOptions& opts) {
  const char* name = "scatter";
  std::optional<at::Device> dev;
  Tensors inList = rootedArgs(name, inputs, outputs, "output", "scatter_list", opts.rootRank, dev);
  Engine& engine = route(name, dev);
  RootedArgs a{{outputs[0]}, inList, static_cast<int>(opts.rootRank)};
  const Issued c = context(name, c10d::OpType::SCATTER, outputs, isAsyncOp(opts));
  return track(engine.scatter(std::move(a), c.op), c.record);
}

c10::intrusive_ptr<c10d::Work> TdxBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                          std::vector<std::vector<at::Tensor>>& inputs,
                                                          const c10d::ReduceScatterOptions& opts) {
  const char* name = "reduce_scatter";
  std::optional<at::Device> dev;
  ReduceScatterArgs a;
  refusable(name, [&] {
    dev = cudaDeviceOf(name, withList(inputs, outputs));
    const TensorCheck check = dev ? checkDeviceTensor : checkTensor;
    TORCH_CHECK_VALUE(outputs.size() == 1 && inputs.size() == 1, "tdx: reduce_scatter takes one output and one "
                      "input list");
    check(name, outputs[0], "output");
    TORCH_CHECK_VALUE(static_cast<int>(inputs[0].size()) == size_, "tdx: reduce_scatter: input list has ",
                      inputs[0].size(), " tensors but the group has ", size_, " ranks; pass one per rank");
    for (size_t p = 0; p < inputs[0].size(); ++p) {
      check(name, inputs[0][p], "input");
      checkSameDtype(name, outputs[0], inputs[0][p], "output and input tensors");
      checkSameNumel(name, outputs[0], inputs[0][p], "input_list", p);
    }
    a.op = toReduceOp(name, opts.reduceOp, outputs[0].scalar_type());
    a.inputs = reducibleOf(inputs[0]);
    a.output = asReducible(outputs[0]);
    a.dtype = reduceDtype(name, a.output.scalar_type());
  });
  Engine& engine = route(name, dev, std::make_pair(a.dtype, a.op));
  const Issued c = context(name, c10d::OpType::REDUCE_SCATTER, outputs, isAsyncOp(opts));
  return track(engine.reduceScatter(std::move(a), c.op), c.record);
}

c10::intrusive_ptr<c10d::Work> TdxBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                const c10d::ReduceScatterOptions& opts) {
  std::vector<at::Tensor> outputs{output}, inputs{input};
  return reduce_scatter_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> TdxBackend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                           std::vector<at::Tensor>& inputs,
                                                                           const c10d::ReduceScatterOptions& opts) {
  return reduceScatterFlatCall(FlatArgs{outputs, inputs}, opts, /*wantsWork=*/true);
}

void TdxBackend::reduceScatterTensorNow(at::Tensor& output, at::Tensor& input,
                                        const c10d::ReduceScatterOptions& opts) {
  reduceScatterFlatCall(FlatArgs{{output}, {input}}, opts, /*wantsWork=*/false);
}

c10::intrusive_ptr<c10d::Work> TdxBackend::reduceScatterFlatCall(FlatArgs a, const c10d::ReduceScatterOptions& opts,
                                                                 bool wantsWork) {
  const char* name = "reduce_scatter_tensor";
  std::optional<at::Device> dev;
  // Complex tensors reduce as their real views, which the engine gets; the Work and the flight
  // recorder keep the caller's tensors. The inputs share one dtype and the outputs have it.
  Tensors realOutputs, realInputs;
  refusable(name, [&] {
    dev = flatPairsDevice(name, a.outputs, a.inputs, size_, /*outputIsLarge=*/false);
    a.op = toReduceOp(name, opts.reduceOp, a.inputs[0].scalar_type());
    if (at::isComplexType(a.inputs[0].scalar_type())) {
      realInputs = reducibleOf(a.inputs);
      realOutputs = reducibleOf(a.outputs);
      a.dtype = reduceDtype(name, realInputs[0].scalar_type());
    } else {
      a.dtype = reduceDtype(name, a.inputs[0].scalar_type());
    }
  });
  Engine& engine = route(name, dev, std::make_pair(a.dtype, a.op));
  const Issued c = context(name, c10d::OpType::_REDUCE_SCATTER_BASE, a.outputs, isAsyncOp(opts) && wantsWork,
                           /*p2p=*/false, a.inputs, -1, wantsWork);
  if (!realInputs.empty()) {
    a.inputs = std::move(realInputs);
    a.outputs = std::move(realOutputs);
  }
  return issue(c, [&] { return engine.reduceScatterFlat(std::move(a), c.op); });
}

c10::intrusive_ptr<c10d::Work> TdxBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                         std::vector<int64_t>& outputSplitSizes,
                                                         std::vector<int64_t>& inputSplitSizes,
                                                         const c10d::AllToAllOptions& opts) {
  const char* name = "all_to_all_single";
  std::optional<at::Device> dev;
  AlltoallArgs a;
  refusable(name, [&] {
    dev = cudaDeviceOf(name, Tensors{input, output});
    const TensorCheck check = dev ? checkDeviceTensor : checkTensor;
    check(name, input, "input");
    check(name, output, "output");
    checkSameDtype(name, input, output, "input and output");
    a.inBytes = splitBytes(name, input, inputSplitSizes, "input", size_);
    a.outBytes = splitBytes(name, output, outputSplitSizes, "output", size_);
  });
  a.inputs = {input};
  a.outputs = {output};
  a.single = true;
  Engine& engine = route(name, dev);
  const Issued c = context(name, c10d::OpType::ALLTOALL_BASE, a.outputs, isAsyncOp(opts), /*p2p=*/false,
                           trace::noted({input}));
  return track(engine.alltoall(std::move(a), c.op), c.record);
}

c10::intrusive_ptr<c10d::Work> TdxBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                    std::vector<at::Tensor>& inputs,
                                                    const c10d::AllToAllOptions& opts) {
  const char* name = "all_to_all";
  std::optional<at::Device> dev;
  refusable(name, [&] {
    dev = cudaDeviceOf(name, inputs, outputs);
    TORCH_CHECK_VALUE(static_cast<int>(inputs.size()) == size_ && static_cast<int>(outputs.size()) == size_,
                      "tdx: ", name, ": got ", inputs.size(), " inputs and ", outputs.size(),
                      " outputs for a group of ", size_, " ranks; pass one of each per rank");
    checkTensors(name, inputs, "inputs", dev ? checkDeviceTensor : checkTensor);
    checkTensors(name, outputs, "outputs", dev ? checkDeviceTensor : checkTensor);
    checkSameDtype(name, inputs[0], outputs[0], "input and output tensors");
  });
  AlltoallArgs a{outputs, inputs};
  for (int p = 0; p < size_; ++p) {
    a.inBytes.push_back(inputs[p].nbytes());
    a.outBytes.push_back(outputs[p].nbytes());
  }
  Engine& engine = route(name, dev);
  const Issued c = context(name, c10d::OpType::ALLTOALL, outputs, isAsyncOp(opts), /*p2p=*/false, inputs);
  return track(engine.alltoall(std::move(a), c.op), c.record);
}

}  // namespace tdx
