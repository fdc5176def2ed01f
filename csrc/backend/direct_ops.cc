// In-place collectives registered with torch's dispatcher (torch.ops.tdx.*), for callers that
// cannot afford torch.distributed's Python and ProcessGroup layers (several microseconds per call,
// more than a small all_reduce on shared memory takes):
//
//   torch.ops.tdx.all_reduce_(tensor, op="sum", group_name="")
//   torch.ops.tdx.all_gather_into_tensor_(output, input, group_name="")
//   torch.ops.tdx.reduce_scatter_tensor_(output, input, op="sum", group_name="")
//
// group_name is a process group's `group_name`, resolved through torch's group registry as torch's
// own functional collectives resolve it; "" is torch.distributed's current default group (also
// after dist.shrink_group replaced it). Each call is the group's tdx backend's own collective
// (same checks, route, engine and sequence number as the c10d call), issued synchronously: it
// runs on the calling thread when nothing is queued and returns its (first) tensor argument.
// Tagged in-place with fake kernels (torchdist_ext/_direct_ops.py), so torch.compile traces them.
#include "backend/direct_ops.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>

#include <atomic>
#include <cctype>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "backend/tdx_backend.h"

namespace tdx {

namespace {

using GroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;

// The default group as last found: the name torch registered it under, and the group (weakly:
// a destroyed group is not kept alive here).
struct DefaultGroup {
  std::mutex mu;
  std::function<std::optional<std::string>()> name;
  std::string lastName;
  std::optional<c10::weak_intrusive_ptr<c10d::ProcessGroup>> last;
};

DefaultGroup& defaultGroup() {
  static DefaultGroup* d = new DefaultGroup();  // never destroyed: ops may run while the process exits
  return *d;
}

// torch's group of `name`, or null when none is registered under it.
GroupPtr registered(const std::string& name) {
  try {
    return c10d::resolve_process_group(name);
  } catch (const std::exception&) {
    return {};
  }
}

GroupPtr resolveDefault(const char* op) {
  DefaultGroup& d = defaultGroup();
  std::function<std::optional<std::string>()> ask;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    if (d.last) {
      GroupPtr pg = d.last->lock();
      if (pg && registered(d.lastName) == pg) return pg;
    }
    ask = d.name;
  }
  TORCH_CHECK(ask, "tdx: torch.ops.tdx.", op, ": the default group is found through the torchdist_ext package; "
              "import torchdist_ext before calling the op");
  // Asked without the lock: it takes the GIL, which another caller may hold while it waits here.
  const std::optional<std::string> name = ask();
  TORCH_CHECK_VALUE(name, "tdx: torch.ops.tdx.", op, ": group_name \"\" is the default process group, and there "
                    "is none; call dist.init_process_group(\"tdx\") first, or pass a group's group_name");
  GroupPtr pg = registered(*name);
  TORCH_CHECK_VALUE(pg, "tdx: torch.ops.tdx.", op, ": the default process group '", *name,
                    "' is not in torch's group registry; it may be being destroyed");
  std::lock_guard<std::mutex> lock(d.mu);
  d.lastName = *name;
  d.last = c10::weak_intrusive_ptr<c10d::ProcessGroup>(pg);
  return pg;
}

// Replaced default-group finders (setDefaultGroupName): a resolution of "" holds while unchanged.
std::atomic<uint64_t> finderVersion{0};

// This thread's last resolution of a group name to its tdx backend. It holds while no tdx backend
// was made, shut down or aborted since (TdxBackend::generation(): torch's destroy_process_group
// shuts its backends down, a new or shrunk group makes one) and the default group's finder is the
// same, so a call skips torch's registry, the backend lookup and the cast; the backend is held
// weakly, as torch's registry holds groups.
struct Resolved {
  uint64_t generation = 0;
  uint64_t finder = 0;
  std::string groupName;
  c10::DeviceType device = c10::DeviceType::CPU;
  c10::weak_intrusive_ptr<c10d::Backend> backend;
};

TdxBackend& tdxBackendOf(const char* op, c10::string_view groupName, at::Device device,
                         c10::intrusive_ptr<c10d::Backend>& keep) {
  thread_local std::optional<Resolved> last;
  const uint64_t generation = TdxBackend::generation(), finder = finderVersion.load(std::memory_order_acquire);
  if (last && last->generation == generation && last->finder == finder && last->device == device.type() &&
      c10::string_view(last->groupName) == groupName) {
    keep = last->backend.lock();
    if (keep) return static_cast<TdxBackend&>(*keep);
  }
  GroupPtr pg;
  if (groupName.empty()) {
    pg = resolveDefault(op);
  } else {
    pg = registered(std::string(groupName));
    TORCH_CHECK_VALUE(pg, "tdx: torch.ops.tdx.", op, ": no process group named '", groupName,
                      "'; pass group.group_name of a live process group, or \"\" for the default one");
  }
  try {
    keep = pg->getBackend(device.type());
  } catch (const std::exception&) {
  }
  auto* tdxb = dynamic_cast<TdxBackend*>(keep.get());
  TORCH_CHECK_VALUE(tdxb, "tdx: torch.ops.tdx.", op, ": process group '", pg->getGroupName(),
                    "' has no tdx backend for ", device.type(), " tensors; create it with backend=\"tdx\" (or use "
                    "torch.distributed's own call)");
  last.emplace(Resolved{generation, finder, std::string(groupName), device.type(),
                        c10::weak_intrusive_ptr<c10d::Backend>(keep)});
  return *tdxb;
}

c10d::ReduceOp parseOp(const char* op, c10::string_view text) {
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

at::Tensor allReduce(at::Tensor tensor, c10::string_view opName, c10::string_view groupName) {
  const char* name = "all_reduce_";
  c10::intrusive_ptr<c10d::Backend> keep;
  TdxBackend& backend = tdxBackendOf(name, groupName, tensor.device(), keep);
  c10d::AllreduceOptions opts;
  opts.reduceOp = parseOp(name, opName);
  std::vector<at::Tensor> tensors{tensor};
  backend.allreduceNow(tensors, opts);
  return tensor;
}

at::Tensor allGatherIntoTensor(at::Tensor output, const at::Tensor& input, c10::string_view groupName) {
  c10::intrusive_ptr<c10d::Backend> keep;
  TdxBackend& backend = tdxBackendOf("all_gather_into_tensor_", groupName, input.device(), keep);
  at::Tensor in = input;
  backend.allgatherIntoTensorNow(output, in);
  return output;
}

at::Tensor reduceScatterTensor(at::Tensor output, const at::Tensor& input, c10::string_view opName,
                               c10::string_view groupName) {
  const char* name = "reduce_scatter_tensor_";
  c10::intrusive_ptr<c10d::Backend> keep;
  TdxBackend& backend = tdxBackendOf(name, groupName, input.device(), keep);
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = parseOp(name, opName);
  at::Tensor in = input;
  backend.reduceScatterTensorNow(output, in, opts);
  return output;
}

// at::Tag::inplace (newer torch): the op mutates its first argument and returns it, which lets
// torch.compile functionalize it. Older torch has no such tag (and cannot trace these ops).
template <typename Tag, typename = void>
struct HasInplaceTag : std::false_type {};
template <typename Tag>
struct HasInplaceTag<Tag, std::void_t<decltype(Tag::inplace)>> : std::true_type {};
template <typename Tag>
std::vector<Tag> inplaceTags() {
  if constexpr (HasInplaceTag<Tag>::value) {
    return {Tag::inplace};
  } else {
    return {};
  }
}

}  // namespace

void setDefaultGroupName(std::function<std::optional<std::string>()> name) {
  DefaultGroup& d = defaultGroup();
  std::lock_guard<std::mutex> lock(d.mu);
  d.name = std::move(name);
  d.last.reset();
  finderVersion.fetch_add(1, std::memory_order_acq_rel);
}

TORCH_LIBRARY(tdx, m) {
  const std::vector<at::Tag> tags = inplaceTags<at::Tag>();
  m.def("all_reduce_(Tensor(a!) tensor, str op=\"sum\", str group_name=\"\") -> Tensor(a!)", tags);
  m.def("all_gather_into_tensor_(Tensor(a!) output, Tensor input, str group_name=\"\") -> Tensor(a!)", tags);
  m.def("reduce_scatter_tensor_(Tensor(a!) output, Tensor input, str op=\"sum\", str group_name=\"\") -> Tensor(a!)",
        tags);
}

TORCH_LIBRARY_IMPL(tdx, CompositeExplicitAutograd, m) {
  m.impl("all_reduce_", &allReduce);
  m.impl("all_gather_into_tensor_", &allGatherIntoTensor);
  m.impl("reduce_scatter_tensor_", &reduceScatterTensor);
}

}  // namespace tdx
