// TdxBackend for CUDA tensors: the route (NCCL, or staging through host memory), planned at the
// group's first CUDA call, and the CUDA side of every collective and p2p operation. Each override
// in tdx_collectives.cc / tdx_backend.cc hands CUDA calls here first.
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>

#include "backend/cuda_staging.h"
#include "backend/tdx_backend.h"
#include "backend/tensor_utils.h"
#include "common/env.h"
#include "common/logging.h"
#include "transport/device_sharing.h"

#ifdef TDX_WITH_CUDA
#include "backend/nccl_path.h"
#endif

namespace tdx {

namespace {

void checkCudaTensor(const char* op, const at::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.defined(), "tdx: ", op, ": ", what, " is an undefined tensor");
  TORCH_CHECK(t.layout() == at::kStrided, "tdx: ", op, ": ", what, " has layout ", t.layout(),
              " but tdx supports dense (strided) tensors only; call .to_dense() first");
}

void checkCudaTensors(const char* op, const std::vector<at::Tensor>& ts, const char* what) {
  for (const auto& t : ts) {
    checkCudaTensor(op, t, what);
    checkSameDtype(op, ts[0], t, what);
  }
}

std::vector<at::Tensor> reducibleOf(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> r;
  for (const auto& t : ts) r.push_back(asReducible(t));
  return r;
}

}  // namespace

CudaRoute TdxBackend::cudaRoute(const char* op, at::Device device) {
  std::lock_guard<std::mutex> lock(cudaMu_);
  if (cudaPlan_) return cudaPlan_->route;
  CudaRoutePlan plan;
  try {
#ifdef TDX_WITH_CUDA
    // Collective: every rank reaches its first CUDA call of the group at the same collective.
    std::vector<std::string> gpus(size_);
    gpus[rank_] = gpuIdentity(device.index());
    const std::string mine = gpus[rank_];
    auto key = [](int r) { return str("tdx/cuda/gpu/", r); };
    store_->set(key(rank_), std::vector<uint8_t>(mine.begin(), mine.end()));
    std::vector<std::string> others;
    for (int r = 0; r < size_; ++r) {
      if (r != rank_) others.push_back(key(r));
    }
    try {
      store_->wait(others, timeout_);
    } catch (const c10::Error&) {  // the store's own timeout names a key; name the collective and the ranks
      std::vector<int> missing;
      for (int r = 0; r < size_; ++r) {
        if (r != rank_ && !store_->check({key(r)})) missing.push_back(r);
      }
      throw TimeoutError(str("tdx: ", op, " (sequence ", collSeq_ + 1, ") in group '", info_.name, "' timed out after ",
                             timeout_.count(), " ms on rank ", info_.describeRank(rank_), ": ranks ",
                             info_.describeRanks(missing), " did not arrive at the group's first CUDA collective "
                             "(where the ranks tell each other their GPUs). They may have crashed, be stuck, or be "
                             "running a different collective; raise the timeout in init_process_group(timeout=...) "
                             "if they are only slow"));
    }
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      auto v = store_->get(key(r));
      gpus[r] = std::string(v.begin(), v.end());
    }
    plan = planCudaRoute(nodeIds_, gpus, env().cudaPath);
#else
    TDX_ENFORCE(env().cudaPath != "nccl", "TDX_CUDA_PATH=nccl but this build of tdx has no NCCL path (it was built "
                "without CUDA: torch had no CUDA or nvcc was missing); rebuild with nvcc on PATH, or unset it");
    plan.route = CudaRoute::kStaged;
    plan.reason = "staged through host shared memory (this build of tdx has no NCCL path)";
#endif
  } catch (const Error& e) {
    TORCH_CHECK(false, e.what(), " (group '", info_.name, "', first CUDA call: ", op, ")");
  }
#ifdef TDX_WITH_CUDA
  if (plan.route == CudaRoute::kNccl) nccl_ = std::make_unique<NcclPath>(store_, info_, device);
#endif
  if (env().debug && rank_ == 0) {
    std::fprintf(stderr, "tdx: group '%s': CUDA tensors go %s\n", info_.name.c_str(), plan.reason.c_str());
  }
  cudaPlan_ = plan;
  return plan.route;
}

bool TdxBackend::useNccl(const char* op, at::Device device, std::optional<std::pair<DataType, ReduceOp>> reduction) {
  checkAlive(op);
  if (cudaRoute(op, device) != CudaRoute::kNccl) return false;
#ifdef TDX_WITH_CUDA
  nccl_->checkUsable(op, device);
  if (reduction && !nccl::supportsReduce(reduction->first, reduction->second)) {
    TORCH_CHECK(!nccl_->coalescing(), "tdx: ", op, ": this dtype / reduce op has no NCCL equivalent and is staged "
                "through host memory, which cannot run inside a coalescing block; call it outside the block");
    return false;
  }
  if (coalescing_ && !nccl_->coalescing()) nccl_->startCoalescing();
  return true;
#else
  (void)reduction;
  return false;
#endif
}

c10::intrusive_ptr<c10d::Work> TdxBackend::track(c10::intrusive_ptr<c10d::Work> w) {
  if (coalescing_ && hostCalls_ == 0) coalesced_.push_back(w);
  return w;
}

c10::intrusive_ptr<c10d::Work> TdxBackend::hostCall(const std::function<c10::intrusive_ptr<c10d::Work>()>& call) {
  ++hostCalls_;
  try {
    auto w = call();
    --hostCalls_;
    return w;
  } catch (...) {
    --hostCalls_;
    throw;
  }
}

void TdxBackend::startCoalescing() {
  TORCH_CHECK(!coalescing_, "tdx: start_coalescing called twice in group '", info_.name, "' without end_coalescing");
  coalescing_ = true;
}

c10::intrusive_ptr<c10d::Work> TdxBackend::endCoalescing() {
  TORCH_CHECK(coalescing_, "tdx: end_coalescing without start_coalescing in group '", info_.name, "'");
  coalescing_ = false;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  works.swap(coalesced_);
#ifdef TDX_WITH_CUDA
  if (nccl_ && nccl_->coalescing()) return nccl_->endCoalescing(++collSeq_, timeout_);
#endif
  // Shared-memory (and staged) operations ran as they came; the block's Work is done when all are.
  std::vector<at::Tensor> outputs;
  for (auto& w : works) {
    w->wait();
    for (auto& t : w->result()) outputs.push_back(t);
  }
  std::vector<c10::Device> devices;
  for (const auto& t : outputs) {
    if (t.is_cuda() && std::find(devices.begin(), devices.end(), t.device()) == devices.end()) {
      devices.push_back(t.device());
    }
  }
  auto work = c10::make_intrusive<TdxWork>(rank_, c10d::OpType::COALESCED, collSeq_, "coalesced", outputs,
                                           std::nullopt, devices);
  work->complete(nullptr);
  return work;
}

// ---- collectives ----

c10::intrusive_ptr<c10d::Work> TdxBackend::cudaAllreduce(at::Device dev, std::vector<at::Tensor>& tensors,
                                                         const c10d::AllreduceOptions& opts) {
  checkNonEmptyList("all_reduce", tensors, "tensors");
  checkCudaTensors("all_reduce", tensors, "tensors");
  TORCH_CHECK(!opts.sparseIndices.has_value(), "tdx: all_reduce of sparse tensors is not supported; use gloo");
  const ReduceOp op = toReduceOp("all_reduce", opts.reduceOp, tensors[0].scalar_type());
  auto reducible = reducibleOf(tensors);
  const DataType dt = reduceDtype("all_reduce", reducible[0].scalar_type());
#ifdef TDX_WITH_CUDA
  if (useNccl("all_reduce", dev, std::make_pair(dt, op))) {
    return track(nccl_->allreduce(reducible, dt, op, ++collSeq_, timeout_));
  }
#else
  useNccl("all_reduce", dev, std::nullopt);
#endif
  auto st = stageLists({tensors}, true);
  auto host = hostLists(st);
  auto w = hostCall([&] { return allreduce(host[0], opts); });
  return track(finishStaged(rank_, c10d::OpType::ALLREDUCE, "all_reduce", dev, w, {&st[0]}, tensors));
}

c10::intrusive_ptr<c10d::Work> TdxBackend::cudaReduce(at::Device dev, std::vector<at::Tensor>& tensors,
                                                      const c10d::ReduceOptions& opts) {
  checkNonEmptyList("reduce", tensors, "tensors");
  checkCudaTensors("reduce", tensors, "tensors");
  checkRoot("reduce", opts.rootRank);
  const ReduceOp op = toReduceOp("reduce", opts.reduceOp, tensors[0].scalar_type());
  auto reducible = reducibleOf(tensors);
  const DataType dt = reduceDtype("reduce", reducible[0].scalar_type());
#ifdef TDX_WITH_CUDA
  if (useNccl("reduce", dev, std::make_pair(dt, op))) {
    return track(nccl_->reduce(reducible, dt, op, static_cast<int>(opts.rootRank), ++collSeq_, timeout_));
  }
#else
  useNccl("reduce", dev, std::nullopt);
#endif
  auto st = stageLists({tensors}, true);
  auto host = hostLists(st);
  auto w = hostCall([&] { return reduce(host[0], opts); });
  std::vector<HostStage*> back;
  if (rank_ == opts.rootRank) back.push_back(&st[0]);
  return track(finishStaged(rank_, c10d::OpType::REDUCE, "reduce", dev, w, back, tensors));
}

c10::intrusive_ptr<c10d::Work> TdxBackend::cudaBroadcast(at::Device dev, std::vector<at::Tensor>& tensors,
                                                         const c10d::BroadcastOptions& opts) {
  checkNonEmptyList("broadcast", tensors, "tensors");
  checkCudaTensors("broadcast", tensors, "tensors");
  checkRoot("broadcast", opts.rootRank);
  TORCH_CHECK_VALUE(opts.rootTensor == 0, "tdx: broadcast: rootTensor must be 0, got ", opts.rootTensor);
#ifdef TDX_WITH_CUDA
  if (useNccl("broadcast", dev, std::nullopt)) {
    return track(nccl_->broadcast(tensors, static_cast<int>(opts.rootRank), ++collSeq_, timeout_));
  }
#else
  useNccl("broadcast", dev, std::nullopt);
#endif
  const bool root = rank_ == opts.rootRank;
  auto st = stageLists({tensors}, root);
  auto host = hostLists(st);
  auto w = hostCall([&] { return broadcast(host[0], opts); });
  std::vector<HostStage*> back;
  if (!root) back.push_back(&st[0]);
  return track(finishStaged(rank_, c10d::OpType::BROADCAST, "broadcast", dev, w, back, tensors));
}

c10::intrusive_ptr<c10d::Work> TdxBackend::cudaAllgather(at::Device dev, std::vector<std::vector<at::Tensor>>& outputs,
                                                         std::vector<at::Tensor>& inputs,
                                                         const c10d::AllgatherOptions& opts) {
  checkNonEmptyList("all_gather", inputs, "input tensors");
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "tdx: all_gather: got ", outputs.size(), " output lists for ",
                    inputs.size(), " inputs; pass one list per input");
  std::vector<at::Tensor> flatOut;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkCudaTensor("all_gather", inputs[i], "input");
    TORCH_CHECK_VALUE(static_cast<int>(outputs[i].size()) == size_, "tdx: all_gather: output list has ",
                      outputs[i].size(), " tensors but the group has ", size_, " ranks; pass one output tensor per "
                      "rank");
    for (const auto& o : outputs[i]) {
      checkCudaTensor("all_gather", o, "output");
      checkSameDtype("all_gather", inputs[i], o, "input and output tensors");
      TORCH_CHECK_VALUE(o.numel() == inputs[i].numel(), "tdx: all_gather: an output has ", o.numel(),
                        " elements but the input has ", inputs[i].numel(), "; every tensor must have the same number "
                        "of elements");
    }
    flatOut.insert(flatOut.end(), outputs[i].begin(), outputs[i].end());
  }
#ifdef TDX_WITH_CUDA
  if (useNccl("all_gather", dev, std::nullopt)) return track(nccl_->allgatherLists(outputs, inputs, ++collSeq_, timeout_));
#else
  useNccl("all_gather", dev, std::nullopt);
#endif
  auto in = stageLists({inputs}, true);
  auto out = stageLists(outputs, false);
  auto hin = hostLists(in);
  auto hout = hostLists(out);
  auto w = hostCall([&] { return allgatherByInput(hout, hin[0], opts); });
  std::vector<HostStage*> back;
  for (auto& s : out) back.push_back(&s);
  return track(finishStaged(rank_, c10d::OpType::ALLGATHER, "all_gather", dev, w, back, flatOut));
}

c10::intrusive_ptr<c10d::Work> TdxBackend::cudaAllgatherInto(at::Device dev, std::vector<at::Tensor>& outputs,
                                                             std::vector<at::Tensor>& inputs,
                                                             const c10d::AllgatherOptions& opts) {
  const char* name = "all_gather_into_tensor";
  checkFlatPairs(name, outputs, inputs, size_, /*outputIsLarge=*/true, /*inputsShareDtype=*/false, checkCudaTensor);
#ifdef TDX_WITH_CUDA
  if (useNccl(name, dev, std::nullopt)) {
    return track(nccl_->allgatherFlat(outputs, inputs, name, c10d::OpType::_ALLGATHER_BASE, ++collSeq_, timeout_));
  }
#else
  useNccl(name, dev, std::nullopt);
#endif
  auto in = stageLists({inputs}, true);
  auto out = stageLists({outputs}, false);
  auto w = hostCall([&] { return allgather_into_tensor_coalesced(out[0].host(), in[0].host(), opts); });
  return track(finishStaged(rank_, c10d::OpType::_ALLGATHER_BASE, name, dev, w, {&out[0]}, outputs));
}

c10::intrusive_ptr<c10d::Work> TdxBackend::cudaGather(at::Device dev, std::vector<std::vector<at::Tensor>>& outputs,
                                                      std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  checkRoot("gather", opts.rootRank);
  TORCH_CHECK_VALUE(inputs.size() == 1, "tdx: gather takes one input tensor, got ", inputs.size());
  checkCudaTensor("gather", inputs[0], "input");
  const int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> outList =
      rootTensorList("gather", "gather_list", "input", outputs, inputs[0], rank_, root, size_, checkCudaTensor);
#ifdef TDX_WITH_CUDA
  if (useNccl("gather", dev, std::nullopt)) return track(nccl_->gather(outList, inputs[0], root, ++collSeq_, timeout_));
#else
  useNccl("gather", dev, std::nullopt);
#endif
  auto in = stageLists({inputs}, true);
  auto out = stageLists({outList}, false);
  std::vector<std::vector<at::Tensor>> hout;
  if (rank_ == root) hout.push_back(out[0].host());
  auto w = hostCall([&] { return gather(hout, in[0].host(), opts); });
  return track(finishStaged(rank_, c10d::OpType::GATHER, "gather", dev, w, {&out[0]}, outList));
}

c10::intrusive_ptr<c10d::Work> TdxBackend::cudaScatter(at::Device dev, std::vector<at::Tensor>& outputs,
                                                       std::vector<std::vector<at::Tensor>>& inputs,
                                                       const c10d::ScatterOptions& opts) {
  checkRoot("scatter", opts.rootRank);
  TORCH_CHECK_VALUE(outputs.size() == 1, "tdx: scatter takes one output tensor, got ", outputs.size());
  checkCudaTensor("scatter", outputs[0], "output");
  const int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> inList =
      rootTensorList("scatter", "scatter_list", "output", inputs, outputs[0], rank_, root, size_, checkCudaTensor);
#ifdef TDX_WITH_CUDA
  if (useNccl("scatter", dev, std::nullopt)) return track(nccl_->scatter(outputs[0], inList, root, ++collSeq_, timeout_));
#else
  useNccl("scatter", dev, std::nullopt);
#endif
  auto in = stageLists({inList}, true);
  auto out = stageLists({outputs}, false);
  std::vector<std::vector<at::Tensor>> hin;
  if (rank_ == root) hin.push_back(in[0].host());
  auto w = hostCall([&] { return scatter(out[0].host(), hin, opts); });
  return track(finishStaged(rank_, c10d::OpType::SCATTER, "scatter", dev, w, {&out[0]}, outputs));
}

c10::intrusive_ptr<c10d::Work> TdxBackend::cudaReduceScatter(at::Device dev, std::vector<at::Tensor>& outputs,
                                                             std::vector<std::vector<at::Tensor>>& inputs,
                                                             const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == 1 && inputs.size() == 1, "tdx: reduce_scatter takes one output and one input "
                    "list");
  checkCudaTensor("reduce_scatter", outputs[0], "output");
  TORCH_CHECK_VALUE(static_cast<int>(inputs[0].size()) == size_, "tdx: reduce_scatter: input list has ",
                    inputs[0].size(), " tensors but the group has ", size_, " ranks; pass one per rank");
  for (const auto& t : inputs[0]) {
    checkCudaTensor("reduce_scatter", t, "input");
    checkSameDtype("reduce_scatter", outputs[0], t, "output and input tensors");
    TORCH_CHECK_VALUE(t.numel() == outputs[0].numel(), "tdx: reduce_scatter: an input has ", t.numel(),
                      " elements but the output has ", outputs[0].numel());
  }
  const ReduceOp op = toReduceOp("reduce_scatter", opts.reduceOp, outputs[0].scalar_type());
  at::Tensor out = asReducible(outputs[0]);
  const DataType dt = reduceDtype("reduce_scatter", out.scalar_type());
#ifdef TDX_WITH_CUDA
  if (useNccl("reduce_scatter", dev, std::make_pair(dt, op))) {
    // NCCL wants one flat input: the list, concatenated on the current stream.
    std::vector<at::Tensor> flat;
    for (const auto& t : inputs[0]) flat.push_back(asReducible(t).reshape({-1}));
    return track(nccl_->reduceScatterFlat({out}, {at::cat(flat)}, dt, op, "reduce_scatter",
                                          c10d::OpType::REDUCE_SCATTER, ++collSeq_, timeout_));
  }
#else
  useNccl("reduce_scatter", dev, std::nullopt);
#endif
  auto in = stageLists(inputs, true);
  auto o = stageLists({outputs}, false);
  auto hin = hostLists(in);
  auto w = hostCall([&] { return reduce_scatter(o[0].host(), hin, opts); });
  return track(finishStaged(rank_, c10d::OpType::REDUCE_SCATTER, "reduce_scatter", dev, w, {&o[0]}, outputs));
}

c10::intrusive_ptr<c10d::Work> TdxBackend::cudaReduceScatterTensor(at::Device dev, std::vector<at::Tensor>& outputs,
                                                                   std::vector<at::Tensor>& inputs,
                                                                   const c10d::ReduceScatterOptions& opts) {
  const char* name = "reduce_scatter_tensor";
  checkFlatPairs(name, outputs, inputs, size_, /*outputIsLarge=*/false, /*inputsShareDtype=*/true, checkCudaTensor);
  const ReduceOp op = toReduceOp(name, opts.reduceOp, inputs[0].scalar_type());
  auto ins = reducibleOf(inputs);
  auto outs = reducibleOf(outputs);
  const DataType dt = reduceDtype(name, ins[0].scalar_type());
#ifdef TDX_WITH_CUDA
  if (useNccl(name, dev, std::make_pair(dt, op))) {
    return track(
        nccl_->reduceScatterFlat(outs, ins, dt, op, name, c10d::OpType::_REDUCE_SCATTER_BASE, ++collSeq_, timeout_));
  }
#else
  useNccl(name, dev, std::nullopt);
#endif
  auto in = stageLists({inputs}, true);
  auto out = stageLists({outputs}, false);
  auto w = hostCall([&] { return reduce_scatter_tensor_coalesced(out[0].host(), in[0].host(), opts); });
  return track(finishStaged(rank_, c10d::OpType::_REDUCE_SCATTER_BASE, name, dev, w, {&out[0]}, outputs));
}

c10::intrusive_ptr<c10d::Work> TdxBackend::cudaAlltoallBase(at::Device dev, at::Tensor& output, at::Tensor& input,
                                                            std::vector<int64_t>& outputSplitSizes,
                                                            std::vector<int64_t>& inputSplitSizes,
                                                            const c10d::AllToAllOptions& opts) {
  const char* name = "all_to_all_single";
  checkCudaTensor(name, input, "input");
  checkCudaTensor(name, output, "output");
  checkSameDtype(name, input, output, "input and output");
#ifdef TDX_WITH_CUDA
  if (useNccl(name, dev, std::nullopt)) {
    auto bytes = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* what) {
      const int64_t dim0 = t.dim() == 0 ? 1 : t.size(0);
      const int64_t rowBytes = dim0 == 0 ? 0 : t.nbytes() / dim0;
      std::vector<int64_t> b(size_);
      if (splits.empty()) {
        TORCH_CHECK_VALUE(dim0 % size_ == 0, "tdx: ", name, ": ", what, " has ", dim0,
                          " rows, not divisible by the world size ", size_, "; pass explicit split sizes");
        for (auto& x : b) x = dim0 / size_ * rowBytes;
        return b;
      }
      TORCH_CHECK_VALUE(static_cast<int>(splits.size()) == size_, "tdx: ", name, ": ", splits.size(), " ", what,
                        " split sizes for a group of ", size_, " ranks; pass one per rank");
      int64_t sum = 0;
      for (int r = 0; r < size_; ++r) {
        TORCH_CHECK_VALUE(splits[r] >= 0, "tdx: ", name, ": negative ", what, " split size ", splits[r]);
        sum += splits[r];
        b[r] = splits[r] * rowBytes;
      }
      TORCH_CHECK_VALUE(sum == dim0, "tdx: ", name, ": ", what, " split sizes sum to ", sum, " but the ", what,
                        " has ", dim0, " rows along dim 0");
      return b;
    };
    const auto ib = bytes(input, inputSplitSizes, "input");
    const auto ob = bytes(output, outputSplitSizes, "output");
    return track(nccl_->alltoallBytes({output}, {input}, ob, ib, name, c10d::OpType::ALLTOALL_BASE, ++collSeq_,
                                      timeout_));
  }
#else
  useNccl(name, dev, std::nullopt);
#endif
  auto in = stageLists({{input}}, true);
  auto out = stageLists({{output}}, false);
  auto w = hostCall([&] { return alltoall_base(out[0].host()[0], in[0].host()[0], outputSplitSizes, inputSplitSizes, opts); });
  return track(finishStaged(rank_, c10d::OpType::ALLTOALL_BASE, name, dev, w, {&out[0]}, {output}));
}

c10::intrusive_ptr<c10d::Work> TdxBackend::cudaAlltoall(at::Device dev, std::vector<at::Tensor>& outputs,
                                                        std::vector<at::Tensor>& inputs,
                                                        const c10d::AllToAllOptions& opts) {
  const char* name = "all_to_all";
  TORCH_CHECK_VALUE(static_cast<int>(inputs.size()) == size_ && static_cast<int>(outputs.size()) == size_, "tdx: ",
                    name, ": got ", inputs.size(), " inputs and ", outputs.size(), " outputs for a group of ", size_,
                    " ranks; pass one of each per rank");
  checkCudaTensors(name, inputs, "inputs");
  checkCudaTensors(name, outputs, "outputs");
  checkSameDtype(name, inputs[0], outputs[0], "input and output tensors");
#ifdef TDX_WITH_CUDA
  if (useNccl(name, dev, std::nullopt)) {
    std::vector<int64_t> ib, ob;
    for (int r = 0; r < size_; ++r) {
      ib.push_back(inputs[r].nbytes());
      ob.push_back(outputs[r].nbytes());
    }
    return track(nccl_->alltoallBytes(outputs, inputs, ob, ib, name, c10d::OpType::ALLTOALL, ++collSeq_, timeout_));
  }
#else
  useNccl(name, dev, std::nullopt);
#endif
  auto in = stageLists({inputs}, true);
  auto out = stageLists({outputs}, false);
  auto w = hostCall([&] { return alltoall(out[0].host(), in[0].host(), opts); });
  return track(finishStaged(rank_, c10d::OpType::ALLTOALL, name, dev, w, {&out[0]}, outputs));
}

// ---- point to point ----

c10::intrusive_ptr<c10d::Work> TdxBackend::cudaP2P(at::Device dev, c10d::OpType type, at::Tensor& tensor, int peer,
                                                   int tag) {
  const bool isSend = type == c10d::OpType::SEND;
  const char* name = isSend ? "send" : "recv";
  checkCudaTensor(name, tensor, "tensor");
#ifdef TDX_WITH_CUDA
  if (useNccl(name, dev, std::nullopt)) {
    TORCH_CHECK(peer >= 0, "tdx: recv from any source is not possible for CUDA tensors on the NCCL path (NCCL must "
                "know the sender); pass src=, or set TDX_CUDA_PATH=staged to move CUDA tensors through host memory");
    return track(isSend ? nccl_->send(tensor, peer, ++p2pSeq_, timeout_)
                        : nccl_->recv(tensor, peer, ++p2pSeq_, timeout_));
  }
#else
  useNccl(name, dev, std::nullopt);
#endif
  auto stage = std::make_shared<HostStage>(std::vector<at::Tensor>{tensor}, isSend);
  std::vector<at::Tensor> hv{stage->host()[0]};
  auto w = hostCall([&] { return isSend ? send(hv, peer, tag) : (peer < 0 ? recvAnysource(hv, tag) : recv(hv, peer, tag)); });
  return track(c10::make_intrusive<StagedP2PWork>(rank_, type, dev, w, isSend ? nullptr : stage, tensor));
}

}  // namespace tdx
