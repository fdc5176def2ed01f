#include "backend/staged_engine.h"

#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include "backend/work.h"

namespace tdx {

namespace {

// The device of a call: its first defined tensor's.
at::Device deviceOf(const Tensors& a, const Tensors& b = {}) {
  const at::Tensor* first = nullptr;
  for (const Tensors* ts : {&a, &b}) {
    for (const auto& t : *ts) {
      if (!first && t.defined()) first = &t;
    }
  }
  TORCH_CHECK(first, "tdx: a staged CUDA call without tensors");
  return first->device();
}

// The host operation's context: its outputs are the host copies, and the call waits for its Work.
OpContext hostContext(const OpContext& c, Tensors outputs) {
  OpContext h = c;
  h.outputs = std::move(outputs);
  h.asyncOp = false;
  h.wantsWork = true;
  return h;
}

}  // namespace

HostStage::HostStage(const Tensors& device, bool copyIn) : device_(device) {
  host_.reserve(device.size());
  for (const auto& t : device) {
    // to() waits for the current stream: the copy sees what the caller queued before the call.
    host_.push_back(copyIn ? t.to(at::kCPU) : at::empty_like(t, t.options().device(at::kCPU)));
  }
}

void HostStage::copyBack() {
  for (size_t i = 0; i < device_.size(); ++i) device_[i].copy_(host_[i]);
}

WorkPtr StagedEngine::finish(const OpContext& c, at::Device device, const WorkPtr& hostWork,
                             std::vector<HostStage*> back) {
  hostWork->wait();  // raises the host collective's error (DistBackendError) here
  c10::DeviceGuard guard(device);
  for (HostStage* s : back) s->copyBack();
  auto work = c10::make_intrusive<TdxWork>(rank_, c.type, c.seq, c.name, c.outputs, std::nullopt,
                                           std::vector<c10::Device>{device});
  work->complete(nullptr);
  return work;
}

WorkPtr StagedEngine::inOut(const Tensors& outputs, const Tensors& inputs, const OpContext& c, const HostCall& call) {
  const at::Device device = deviceOf(outputs, inputs);
  HostStage in(inputs, true), out(outputs, false);
  WorkPtr w = call(out.host(), in.host(), hostContext(c, out.host()));
  return finish(c, device, w, {&out});
}

WorkPtr StagedEngine::allreduce(ReduceArgs a, const OpContext& c) {
  HostStage st(a.tensors, true);
  const at::Device device = deviceOf(a.tensors);
  const bool back = a.root < 0 || a.root == rank_;
  a.tensors = st.host();
  WorkPtr w = host_.allreduce(a, hostContext(c, st.host()));
  return finish(c, device, w, back ? std::vector<HostStage*>{&st} : std::vector<HostStage*>{});
}

WorkPtr StagedEngine::broadcast(BroadcastArgs a, const OpContext& c) {
  const bool root = a.root == rank_;
  HostStage st(a.tensors, root);
  const at::Device device = deviceOf(a.tensors);
  a.tensors = st.host();
  WorkPtr w = host_.broadcast(a, hostContext(c, st.host()));
  return finish(c, device, w, root ? std::vector<HostStage*>{} : std::vector<HostStage*>{&st});
}

WorkPtr StagedEngine::allgather(AllgatherArgs a, const OpContext& c) {
  const at::Device device = deviceOf(a.inputs);
  HostStage in(a.inputs, true);
  std::vector<HostStage> outs;
  Tensors hostOutputs;
  for (auto& list : a.outputs) {
    outs.emplace_back(list, false);
    list = outs.back().host();
    hostOutputs.insert(hostOutputs.end(), list.begin(), list.end());
  }
  a.inputs = in.host();
  WorkPtr w = host_.allgather(a, hostContext(c, hostOutputs));
  std::vector<HostStage*> back;
  for (auto& s : outs) back.push_back(&s);
  return finish(c, device, w, back);
}

WorkPtr StagedEngine::allgatherFlat(FlatArgs a, const OpContext& c) {
  return inOut(a.outputs, a.inputs, c, [&](Tensors o, Tensors i, const OpContext& h) {
    return host_.allgatherFlat(FlatArgs{std::move(o), std::move(i), a.dtype, a.op}, h);
  });
}

WorkPtr StagedEngine::reduceScatterFlat(FlatArgs a, const OpContext& c) {
  return inOut(a.outputs, a.inputs, c, [&](Tensors o, Tensors i, const OpContext& h) {
    return host_.reduceScatterFlat(FlatArgs{std::move(o), std::move(i), a.dtype, a.op}, h);
  });
}

WorkPtr StagedEngine::gather(RootedArgs a, const OpContext& c) {
  return inOut(a.outputs, a.inputs, c, [&](Tensors o, Tensors i, const OpContext& h) {
    return host_.gather(RootedArgs{std::move(o), std::move(i), a.root}, h);
  });
}

WorkPtr StagedEngine::scatter(RootedArgs a, const OpContext& c) {
  return inOut(a.outputs, a.inputs, c, [&](Tensors o, Tensors i, const OpContext& h) {
    return host_.scatter(RootedArgs{std::move(o), std::move(i), a.root}, h);
  });
}

WorkPtr StagedEngine::reduceScatter(ReduceScatterArgs a, const OpContext& c) {
  return inOut({a.output}, a.inputs, c, [&](Tensors o, Tensors i, const OpContext& h) {
    return host_.reduceScatter(ReduceScatterArgs{o[0], std::move(i), a.dtype, a.op}, h);
  });
}

WorkPtr StagedEngine::alltoall(AlltoallArgs a, const OpContext& c) {
  return inOut(a.outputs, a.inputs, c, [&](Tensors o, Tensors i, const OpContext& h) {
    return host_.alltoall(AlltoallArgs{std::move(o), std::move(i), a.outBytes, a.inBytes, a.single}, h);
  });
}

WorkPtr StagedEngine::p2p(P2PArgs a, const OpContext& c, bool isSend) {
  auto stage = std::make_shared<HostStage>(Tensors{a.tensor}, isSend);
  P2PArgs h{stage->host()[0], a.peer, a.tag};
  OpContext hc = c;
  hc.outputs = {h.tensor};
  WorkPtr w = isSend ? host_.send(h, hc) : host_.recv(h, hc);
  return c10::make_intrusive<StagedP2PWork>(rank_, c.type, a.tensor.device(), w, isSend ? nullptr : stage, a.tensor);
}

WorkPtr StagedEngine::barrier(const OpContext& c) { return host_.barrier(c); }
WorkPtr StagedEngine::send(P2PArgs a, const OpContext& c) { return p2p(std::move(a), c, true); }
WorkPtr StagedEngine::recv(P2PArgs a, const OpContext& c) { return p2p(std::move(a), c, false); }

StagedP2PWork::StagedP2PWork(int rank, c10d::OpType type, at::Device device, WorkPtr hostWork,
                             std::shared_ptr<HostStage> back, at::Tensor tensor)
    : c10d::Work(rank, type, type == c10d::OpType::SEND ? "send" : "recv"),
      device_(device),
      hostWork_(std::move(hostWork)),
      back_(std::move(back)),
      tensor_(std::move(tensor)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                       std::vector<c10::Device>{device})) {}

void StagedP2PWork::finishOnce() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (done_) return;
  c10::DeviceGuard guard(device_);
  if (back_) back_->copyBack();
  done_ = true;
  completed_ = true;
  future_->markCompleted(c10::IValue(std::vector<at::Tensor>{tensor_}));
}

bool StagedP2PWork::isCompleted() {
  if (!hostWork_->isCompleted()) return false;
  if (hostWork_->exception()) std::rethrow_exception(hostWork_->exception());
  finishOnce();
  return true;
}

bool StagedP2PWork::wait(std::chrono::milliseconds timeout) {
  hostWork_->wait(timeout);
  finishOnce();
  return true;
}

}  // namespace tdx
