// The NCCL engine: NcclPath behind the Engine interface (registered by register.cc).
#include <c10/util/Exception.h>

#include "cuda/cuda_entry.h"
#include "cuda/nccl_path.h"

namespace tdx {

namespace {

class NcclEngine : public DeviceEngine {
 public:
  NcclEngine(c10::intrusive_ptr<c10d::Store> store, const GroupInfo& info, at::Device device)
      : path_(std::move(store), info, device) {}

  WorkPtr allreduce(ReduceArgs a, const OpContext& c) override {
    TORCH_CHECK(a.scale == 1.0, "tdx: ", c.name, ": a scaled sum (PREMUL_SUM) is not offered for CUDA tensors");
    if (a.root >= 0) return path_.reduce(a.tensors, a.dtype, a.op, a.root, c.seq, c.timeout);
    return path_.allreduce(a.tensors, a.dtype, a.op, c.seq, c.timeout);
  }
  WorkPtr broadcast(BroadcastArgs a, const OpContext& c) override {
    return path_.broadcast(a.tensors, a.root, c.seq, c.timeout);
  }
  WorkPtr allgather(AllgatherArgs a, const OpContext& c) override {
    return path_.allgatherLists(a.outputs, a.inputs, c.seq, c.timeout);
  }
  WorkPtr allgatherFlat(FlatArgs a, const OpContext& c) override {
    return path_.allgatherFlat(a.outputs, a.inputs, c.name, c.type, c.seq, c.timeout);
  }
  WorkPtr gather(RootedArgs a, const OpContext& c) override {
    return path_.gather(a.outputs, a.inputs[0], a.root, c.seq, c.timeout);
  }
  WorkPtr scatter(RootedArgs a, const OpContext& c) override {
    return path_.scatter(a.outputs[0], a.inputs, a.root, c.seq, c.timeout);
  }
  WorkPtr reduceScatter(ReduceScatterArgs a, const OpContext& c) override {
    // NCCL wants one flat input: the list, concatenated on the current stream.
    Tensors flat;
    for (const auto& t : a.inputs) flat.push_back(t.reshape({-1}));
    return path_.reduceScatterFlat({a.output}, {at::cat(flat)}, a.dtype, a.op, c.name, c.type, c.seq, c.timeout);
  }
  WorkPtr reduceScatterFlat(FlatArgs a, const OpContext& c) override {
    return path_.reduceScatterFlat(a.outputs, a.inputs, a.dtype, a.op, c.name, c.type, c.seq, c.timeout);
  }
  WorkPtr alltoall(AlltoallArgs a, const OpContext& c) override {
    return path_.alltoallBytes(a.outputs, a.inputs, a.outBytes, a.inBytes, c.name, c.type, c.seq, c.timeout);
  }
  WorkPtr send(P2PArgs a, const OpContext& c) override { return path_.send(a.tensor, a.peer, c.seq, c.timeout); }
  WorkPtr recv(P2PArgs a, const OpContext& c) override { return path_.recv(a.tensor, a.peer, c.seq, c.timeout); }
  WorkPtr barrier(const OpContext& c) override {
    TORCH_CHECK(false, "tdx: ", c.name, " has no tensors and runs on the host engine");
    return {};
  }
  void shutdown() override { path_.shutdown(); }
  void abort() override { path_.abort(); }

  void checkUsable(const char* op, at::Device device) const override { path_.checkUsable(op, device); }
  bool reduces(DataType dtype, ReduceOp op) const override { return nccl::supportsReduce(dtype, op); }
  void joinCoalescing() override {
    if (!path_.coalescing()) path_.startCoalescing();
  }
  bool coalescing() const override { return path_.coalescing(); }
  WorkPtr endCoalescing(uint64_t seq, std::chrono::milliseconds timeout) override {
    return path_.endCoalescing(seq, timeout);
  }

 private:
  NcclPath path_;
};

}  // namespace

std::unique_ptr<DeviceEngine> makeNcclEngine(c10::intrusive_ptr<c10d::Store> store, const GroupInfo& info,
                                             at::Device device) {
  return std::make_unique<NcclEngine>(std::move(store), info, device);
}

}  // namespace tdx
