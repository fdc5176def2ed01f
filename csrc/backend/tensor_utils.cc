#include "backend/tensor_utils.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>

#include <string>

namespace tdx {

void checkTensor(const char* op, const at::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.defined(), "tdx: ", op, ": ", what, " is an undefined tensor");
  TORCH_CHECK(t.device().is_cpu(), "tdx: ", op, ": ", what, " is on ", t.device(),
              " but tdx handles CPU and CUDA tensors only (and all tensors of one call on one device); move it to "
              "the CPU or a GPU");
  TORCH_CHECK(t.layout() == at::kStrided, "tdx: ", op, ": ", what, " has layout ", t.layout(),
              " but tdx supports dense (strided) tensors only; call .to_dense() first or use gloo for sparse "
              "tensors");
}

void checkDeviceTensor(const char* op, const at::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.defined(), "tdx: ", op, ": ", what, " is an undefined tensor");
  TORCH_CHECK(t.layout() == at::kStrided, "tdx: ", op, ": ", what, " has layout ", t.layout(),
              " but tdx supports dense (strided) tensors only; call .to_dense() first");
}

namespace {

// Scans a call's tensors for cudaDeviceOf without copying them into one list.
class DeviceScan {
 public:
  explicit DeviceScan(const char* op) : op_(op) {}
  void add(const std::vector<at::Tensor>& tensors) {
    for (const auto& t : tensors) {
      if (!t.defined()) continue;
      anyCuda_ = anyCuda_ || t.is_cuda();
      if (!first_) {
        first_ = &t;
      } else {
        TORCH_CHECK_VALUE(t.device() == first_->device(), "tdx: ", op_, ": the tensors of one call are on different "
                          "devices (", first_->device(), " and ", t.device(), "); put every input and output of a "
                          "call on the same device (one GPU per rank, or the CPU)");
      }
    }
  }
  std::optional<at::Device> device() const {
    if (!anyCuda_) return std::nullopt;
    return first_->device();
  }

 private:
  const char* op_;
  const at::Tensor* first_ = nullptr;
  bool anyCuda_ = false;
};

}  // namespace

std::optional<at::Device> cudaDeviceOf(const char* op, const std::vector<at::Tensor>& tensors) {
  DeviceScan scan(op);
  scan.add(tensors);
  return scan.device();
}

std::optional<at::Device> cudaDeviceOf(const char* op, const std::vector<at::Tensor>& first,
                                       const std::vector<at::Tensor>& second) {
  DeviceScan scan(op);
  scan.add(first);
  scan.add(second);
  return scan.device();
}

std::optional<at::Device> cudaDeviceOf(const char* op, const std::vector<std::vector<at::Tensor>>& lists) {
  DeviceScan scan(op);
  for (const auto& l : lists) scan.add(l);
  return scan.device();
}

void checkTensors(const char* op, const std::vector<at::Tensor>& ts, const char* what, TensorCheck checkOne) {
  for (size_t i = 0; i < ts.size(); ++i) {
    checkOne(op, ts[i], what);
    if (i > 0) checkSameDtype(op, ts[0], ts[i], what);
  }
}

void checkSameDtype(const char* op, const at::Tensor& ref, const at::Tensor& t, const char* what) {
  TORCH_CHECK_TYPE(ref.scalar_type() == t.scalar_type(), "tdx: ", op, ": ", what, " mix dtypes ",
                   ref.scalar_type(), " and ", t.scalar_type(), "; all tensors of one call must share a dtype");
}

void checkNonEmptyList(const char* op, const std::vector<at::Tensor>& ts, const char* what) {
  TORCH_CHECK_VALUE(!ts.empty(), "tdx: ", op, ": ", what, " is empty; pass at least one tensor");
}

std::vector<at::Tensor> rootTensorList(const char* op, const char* listName, const char* refName,
                                       const std::vector<std::vector<at::Tensor>>& lists, const at::Tensor& ref,
                                       int rank, int root, int size, TensorCheck checkOne) {
  if (rank != root) {
    TORCH_CHECK_VALUE(lists.empty() || lists[0].empty(), "tdx: ", op, ": only the root (rank ", root,
                      ") may pass a ", listName);
    return {};
  }
  TORCH_CHECK_VALUE(lists.size() == 1 && static_cast<int>(lists[0].size()) == size, "tdx: ", op,
                    ": the root needs a ", listName, " of ", size, " tensors (one per rank)");
  const std::string what = std::string(listName) + " tensor";
  const std::string pair = std::string(refName) + " and " + listName + " tensors";
  for (size_t p = 0; p < lists[0].size(); ++p) {
    const at::Tensor& t = lists[0][p];
    checkOne(op, t, what.c_str());
    checkSameDtype(op, ref, t, pair.c_str());
    TORCH_CHECK_VALUE(t.numel() == ref.numel(), "tdx: ", op, ": ", listName, "[", p, "] has ", t.numel(),
                      " elements but the ", refName, " has ", ref.numel(), "; every tensor must have the same "
                      "number of elements");
  }
  return lists[0];
}

void checkFlatPairs(const char* op, const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                    int size, bool outputIsLarge, bool inputsShareDtype, TensorCheck checkOne) {
  checkNonEmptyList(op, inputs, "inputs");
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "tdx: ", op, ": ", outputs.size(), " outputs for ",
                    inputs.size(), " inputs");
  const char* large = outputIsLarge ? "output" : "input";
  const char* small = outputIsLarge ? "input" : "output";
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkOne(op, inputs[i], "input");
    checkOne(op, outputs[i], "output");
    if (inputsShareDtype) checkSameDtype(op, inputs[0], inputs[i], "inputs");
    checkSameDtype(op, inputs[i], outputs[i], "input and output");
    const int64_t big = (outputIsLarge ? outputs[i] : inputs[i]).numel();
    const int64_t part = (outputIsLarge ? inputs[i] : outputs[i]).numel();
    TORCH_CHECK_VALUE(big == part * size, "tdx: ", op, ": ", large, " has ", big, " elements but must have world size (",
                      size, ") x ", small, " (", part, ") = ", part * size);
  }
}

DataType reduceDtype(const char* op, at::ScalarType st) {
  switch (st) {
    case at::kFloat: return DataType::kFloat32;
    case at::kDouble: return DataType::kFloat64;
    case at::kHalf: return DataType::kFloat16;
    case at::kBFloat16: return DataType::kBFloat16;
    case at::kChar: return DataType::kInt8;
    case at::kShort: return DataType::kInt16;
    case at::kInt: return DataType::kInt32;
    case at::kLong: return DataType::kInt64;
    case at::kByte: return DataType::kUInt8;
    case at::kBool: return DataType::kBool;
    default: break;
  }
  TORCH_CHECK_TYPE(false, "tdx: ", op, ": dtype ", st,
                   " cannot be reduced; supported are float32, float64, float16, bfloat16, int8, int16, int32, "
                   "int64, uint8, bool and (for SUM/AVG) complex64/complex128");
}

double premulFactor(const char* op, const c10d::ReduceOp& rop, at::ScalarType st) {
  TORCH_CHECK_VALUE(rop.op_ == c10d::ReduceOp::PREMUL_SUM, "tdx: ", op, ": premulFactor of a reduce op that is not "
                    "PREMUL_SUM");
  TORCH_CHECK_VALUE(at::isFloatingType(st), "tdx: ", op, ": PREMUL_SUM needs a real floating-point tensor (float32, "
                    "float64, float16, bfloat16) but got ", st, "; multiply the tensor yourself and use SUM");
  // NCCLPreMulSumSupplement: torch <= 2.11's name, an alias of PreMulSumSupplement in later ones.
  const auto* sup = dynamic_cast<const c10d::NCCLPreMulSumSupplement*>(rop.supplement_.get());
  TORCH_CHECK_VALUE(sup != nullptr, "tdx: ", op, ": PREMUL_SUM without its factor; create the op with "
                    "torch.distributed._make_nccl_premul_sum(factor)");
  if (!sup->tensor_factor.defined()) return sup->double_factor;
  return sup->tensor_factor.item<double>();
}

ReduceOp toReduceOp(const char* op, const c10d::ReduceOp& rop, at::ScalarType st) {
  const bool complex = at::isComplexType(st);
  ReduceOp r;
  switch (rop.op_) {
    case c10d::ReduceOp::SUM: r = ReduceOp::kSum; break;
    case c10d::ReduceOp::AVG: r = ReduceOp::kAvg; break;
    case c10d::ReduceOp::PRODUCT: r = ReduceOp::kProduct; break;
    case c10d::ReduceOp::MIN: r = ReduceOp::kMin; break;
    case c10d::ReduceOp::MAX: r = ReduceOp::kMax; break;
    case c10d::ReduceOp::BAND: r = ReduceOp::kBand; break;
    case c10d::ReduceOp::BOR: r = ReduceOp::kBor; break;
    case c10d::ReduceOp::BXOR: r = ReduceOp::kBxor; break;
    default:
      TORCH_CHECK_VALUE(false, "tdx: ", op, ": reduce op ", static_cast<int>(rop.op_),
                        " is not supported here", (rop.op_ == c10d::ReduceOp::PREMUL_SUM ? " (PREMUL_SUM is supported by "
                        "all_reduce on CPU tensors only)" : ""), "; multiply the tensor yourself and use SUM");
  }
  if (complex) {
    TORCH_CHECK_VALUE(r == ReduceOp::kSum || r == ReduceOp::kAvg, "tdx: ", op, ": reduce op ", reduceOpName(r),
                      " is not defined for complex dtype ", st, "; use SUM or AVG");
    return r;
  }
  DataType dt = reduceDtype(op, st);
  if (!reduceOpSupported(dt, r)) {
    if (r == ReduceOp::kAvg) {
      TORCH_CHECK_VALUE(false, "tdx: ", op, ": ReduceOp.AVG needs a floating-point tensor but got ", st,
                        "; use SUM and divide by the world size");
    }
    TORCH_CHECK_VALUE(false, "tdx: ", op, ": ReduceOp.", reduceOpName(r), " is a bitwise op and needs an integer "
                      "or bool tensor, but got ", st);
  }
  return r;
}

at::Tensor asReducible(const at::Tensor& t) { return at::isComplexType(t.scalar_type()) ? at::view_as_real(t) : t; }

at::Tensor bytesOf(const at::Tensor& t) {
  if (!t.is_contiguous() || t.is_conj() || t.is_neg() || t.layout() != at::kStrided || !t.device().is_cpu() ||
      t.unsafeGetTensorImpl()->is_python_dispatch()) {
    return t.reshape({-1}).view(at::kByte);  // a copy for non-contiguous tensors, as before
  }
  // The same storage, no autograd history (the collectives write through it as through the view).
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(t.storage()), t.key_set(),
                                                   caffe2::TypeMeta::Make<uint8_t>());
  impl->set_storage_offset(t.storage_offset() * static_cast<int64_t>(t.element_size()));
  impl->set_sizes_contiguous({static_cast<int64_t>(t.nbytes())});
  return at::Tensor(std::move(impl));
}

Staged::Staged(const at::Tensor& t, bool copyIn, bool separate) : user_(t) {
  if (separate && t.is_contiguous()) {
    work_ = copyIn ? t.clone() : at::empty_like(t);
  } else if (t.is_contiguous()) {
    work_ = t;
  } else {
    work_ = copyIn ? t.contiguous() : at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
  }
}

void Staged::finish() {
  if (!work_.is_same(user_)) user_.copy_(work_);
}

namespace {

// Which tensors share memory with another of the list (contiguous ones; the others are copied anyway).
std::vector<bool> overlapping(const std::vector<at::Tensor>& ts) {
  std::vector<bool> marked(ts.size(), false);
  if (ts.size() < 2) return marked;
  struct Extent {
    uintptr_t begin, end;
    size_t index;
  };
  std::vector<Extent> ext;
  for (size_t i = 0; i < ts.size(); ++i) {
    const at::Tensor& t = ts[i];
    if (!t.is_contiguous() || t.nbytes() == 0) continue;  // non-contiguous ones are copied anyway
    const auto b = reinterpret_cast<uintptr_t>(t.data_ptr());
    ext.push_back(Extent{b, b + t.nbytes(), i});
  }
  std::sort(ext.begin(), ext.end(), [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
  // In order of start: an extent that begins before the furthest end so far overlaps the extent
  // holding that end. Every extent that overlaps another is marked this way.
  uintptr_t furthest = 0;
  size_t holder = 0;
  for (const auto& e : ext) {
    if (e.begin < furthest) {
      marked[e.index] = true;
      marked[holder] = true;
    }
    if (e.end > furthest) {
      furthest = e.end;
      holder = e.index;
    }
  }
  return marked;
}

}  // namespace

std::vector<Staged> stageAll(const std::vector<at::Tensor>& ts, bool copyIn) {
  std::vector<Staged> out;
  out.reserve(ts.size());
  // Inputs that share memory (the same tensor twice in a coalesced all_reduce, overlapping views)
  // are reduced from copies taken now and written back in list order, as Gloo's coalesced
  // all_reduce does: reduced in place, one would overwrite what the next still has to read.
  const std::vector<bool> separate = copyIn ? overlapping(ts) : std::vector<bool>(ts.size(), false);
  for (size_t i = 0; i < ts.size(); ++i) out.emplace_back(ts[i], copyIn, separate[i]);
  return out;
}

void finishAll(std::vector<Staged>& staged) {
  for (auto& s : staged) s.finish();
}

SpanList spanList(const std::vector<Staged>& staged) {
  SpanList l;
  for (const auto& s : staged) l.add(s.data(), s.bytes());
  return l;
}

std::vector<Span> spans(const std::vector<Staged>& staged) {
  std::vector<Span> v;
  v.reserve(staged.size());
  for (const auto& s : staged) v.push_back(s.span());
  return v;
}

std::vector<at::Tensor> StagedSet::tensors() const {
  std::vector<at::Tensor> ts;
  ts.reserve(items.size());
  for (const auto& s : items) ts.push_back(s.tensor());
  return ts;
}

std::shared_ptr<StagedSet> stagedSet(const std::vector<at::Tensor>& ts, bool copyIn) {
  return std::make_shared<StagedSet>(StagedSet{stageAll(ts, copyIn)});
}

}  // namespace tdx
