// In-place collectives registered with torch's dispatcher (torch.ops.tdx.*), for callers that
// cannot afford torch.distributed's Python and ProcessGroup layers (several microseconds per call,
// more than a small all_reduce on shared memory takes). They run the same collectives as the c10d
// backend, on the same group and in the same order (they take the group's next sequence number):
//
//   torch.ops.tdx.all_reduce_(tensor, op="sum", group_name="")
//   torch.ops.tdx.all_gather_into_tensor_(output, input, group_name="")
//   torch.ops.tdx.reduce_scatter_tensor_(output, input, op="sum", group_name="")
//
// group_name is a process group's `group_name` (a group created with backend "tdx"); "" is the
// default group. Each returns its (first) tensor argument. A group that spans hosts, or CUDA
// tensors, take the c10d path of the same backend (same result, without the saving).
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>

#include <cctype>
#include <string>

#include "backend/tdx_backend.h"
#include "backend/tensor_utils.h"
#include "collectives/collectives.h"
#include "common/env.h"

namespace tdx {

namespace {

// torch names the default group "0" (distributed_c10d._process_group_name).
constexpr const char* kDefaultGroupName = "0";

c10::intrusive_ptr<c10d::Backend> tdxBackendOf(const char* op, const std::string& groupName, at::Device device) {
  const std::string name = groupName.empty() ? kDefaultGroupName : groupName;
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  try {
    pg = c10d::resolve_process_group(name);
  } catch (const std::exception&) {
    TORCH_CHECK_VALUE(false, "tdx: torch.ops.tdx.", op, ": no process group named '", name, "'",
                      groupName.empty() ? " (the default group): call dist.init_process_group(\"tdx\") first"
                                        : "; pass group.group_name of a live process group, or \"\" for the default",
                      "");
  }
  c10::intrusive_ptr<c10d::Backend> backend;
  try {
    backend = pg->getBackend(device.type());
  } catch (const std::exception&) {
  }
  TORCH_CHECK_VALUE(backend && dynamic_cast<TdxBackend*>(backend.get()), "tdx: torch.ops.tdx.", op,
                    ": process group '", name, "' has no tdx backend for ", device.type(),
                    " tensors; create it with backend=\"tdx\" (or use torch.distributed's own call)");
  return backend;
}

c10d::ReduceOp parseOp(const char* op, const std::string& text) {
  std::string s;
  for (char c : text) s += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s == "sum") return c10d::ReduceOp::SUM;
  if (s == "avg") return c10d::ReduceOp::AVG;
  if (s == "product") return c10d::ReduceOp::PRODUCT;
  if (s == "min") return c10d::ReduceOp::MIN;
  if (s == "max") return c10d::ReduceOp::MAX;
  if (s == "band") return c10d::ReduceOp::BAND;
  if (s == "bor") return c10d::ReduceOp::BOR;
  if (s == "bxor") return c10d::ReduceOp::BXOR;
  TORCH_CHECK_VALUE(false, "tdx: torch.ops.tdx.", op, ": unknown reduce op '", text,
                    "'; use one of sum, avg, product, min, max, band, bor, bxor");
}

void waitSync(const c10::intrusive_ptr<c10d::Work>& w) { w->wait(); }

at::Tensor allReduce(at::Tensor tensor, c10::string_view opName, c10::string_view groupName) {
  const char* name = "all_reduce_";
  auto backend = tdxBackendOf(name, std::string(groupName), tensor.device());
  auto* tdxb = static_cast<TdxBackend*>(backend.get());
  const c10d::ReduceOp rop = parseOp(name, std::string(opName));
  if (tensor.is_cpu()) {
    checkTensor(name, tensor);
    const at::Tensor reducible = asReducible(tensor);
    const ReduceOp op = toReduceOp(name, rop, reducible.scalar_type());
    const DataType dt = reduceDtype(name, reducible.scalar_type());
    Staged staged(reducible);
    const bool ran = tdxb->runDirect("all_reduce", [&](shm::ShmGroup& g, const WaitContext& ctx) {
      AllreduceOptions o;
      o.in = o.out = SpanList(staged.data(), staged.bytes());
      o.dtype = dt;
      o.op = op;
      o.oneshotBytes = env().oneshotBytes;
      tdx::allreduce(g, o, ctx);
      staged.finish();
    }, trace::noted({tensor}), trace::noted({tensor}));
    if (ran) return tensor;
  }
  std::vector<at::Tensor> ts{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = rop;
  waitSync(tdxb->allreduce(ts, opts));
  return tensor;
}

at::Tensor allGatherIntoTensor(at::Tensor output, const at::Tensor& input, c10::string_view groupName) {
  const char* name = "all_gather_into_tensor_";
  auto backend = tdxBackendOf(name, std::string(groupName), input.device());
  auto* tdxb = static_cast<TdxBackend*>(backend.get());
  const int n = tdxb->getSize();
  if (input.is_cpu() && output.is_cpu()) {
    checkFlatPairs(name, {output}, {input}, n, /*outputIsLarge=*/true, /*inputsShareDtype=*/false, checkTensor);
    Staged in(input);
    Staged out(output, /*copyIn=*/false);
    const bool ran = tdxb->runDirect("all_gather_into_tensor", [&](shm::ShmGroup& g, const WaitContext& ctx) {
      AllgatherOptions o;
      o.in = in.span();
      for (int p = 0; p < n; ++p) o.out.push_back(Span{static_cast<char*>(out.data()) + p * in.bytes(), in.bytes()});
      tdx::allgather(g, o, ctx);
      out.finish();
    }, trace::noted({input}), trace::noted({output}));
    if (ran) return output;
  }
  at::Tensor in = input;
  waitSync(tdxb->_allgather_base(output, in));
  return output;
}

at::Tensor reduceScatterTensor(at::Tensor output, const at::Tensor& input, c10::string_view opName,
                               c10::string_view groupName) {
  const char* name = "reduce_scatter_tensor_";
  auto backend = tdxBackendOf(name, std::string(groupName), input.device());
  auto* tdxb = static_cast<TdxBackend*>(backend.get());
  const int n = tdxb->getSize();
  const c10d::ReduceOp rop = parseOp(name, std::string(opName));
  if (input.is_cpu() && output.is_cpu()) {
    checkFlatPairs(name, {output}, {input}, n, /*outputIsLarge=*/false, /*inputsShareDtype=*/true, checkTensor);
    const at::Tensor rin = asReducible(input);
    const ReduceOp op = toReduceOp(name, rop, rin.scalar_type());
    const DataType dt = reduceDtype(name, rin.scalar_type());
    Staged in(rin);
    Staged out(asReducible(output), /*copyIn=*/false);
    const bool ran = tdxb->runDirect("reduce_scatter_tensor", [&](shm::ShmGroup& g, const WaitContext& ctx) {
      ReduceScatterOptions o;
      o.out = out.span();
      o.dtype = dt;
      o.op = op;
      for (int p = 0; p < n; ++p) o.in.push_back(Span{static_cast<char*>(in.data()) + p * out.bytes(), out.bytes()});
      tdx::reduceScatter(g, o, ctx);
      out.finish();
    }, trace::noted({input}), trace::noted({output}));
    if (ran) return output;
  }
  at::Tensor in = input;
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = rop;
  waitSync(tdxb->_reduce_scatter_base(output, in, opts));
  return output;
}

}  // namespace

TORCH_LIBRARY(tdx, m) {
  m.def("all_reduce_(Tensor(a!) tensor, str op=\"sum\", str group_name=\"\") -> Tensor(a!)");
  m.def("all_gather_into_tensor_(Tensor(a!) output, Tensor input, str group_name=\"\") -> Tensor(a!)");
  m.def("reduce_scatter_tensor_(Tensor(a!) output, Tensor input, str op=\"sum\", str group_name=\"\") -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(tdx, CompositeExplicitAutograd, m) {
  m.impl("all_reduce_", &allReduce);
  m.impl("all_gather_into_tensor_", &allGatherIntoTensor);
  m.impl("reduce_scatter_tensor_", &reduceScatterTensor);
}

}  // namespace tdx
