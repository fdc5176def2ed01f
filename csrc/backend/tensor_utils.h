// Input validation and tensor -> span conversion for the backend. Every check raises an error
// that names the operation, the offending tensor and what to do instead.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <memory>
#include <optional>
#include <vector>

#include "collectives/types.h"

namespace tdx {

// The CUDA device of a call, or nullopt when no tensor is on a GPU (undefined tensors are
// skipped). Throws a ValueError naming both devices when a call mixes devices.
std::optional<at::Device> cudaDeviceOf(const char* op, const std::vector<at::Tensor>& tensors);
std::optional<at::Device> cudaDeviceOf(const char* op, const std::vector<at::Tensor>& first,
                                       const std::vector<at::Tensor>& second);
std::optional<at::Device> cudaDeviceOf(const char* op, const std::vector<std::vector<at::Tensor>>& lists);

// Checks one tensor: checkTensor for a CPU call (device CPU, layout strided), checkDeviceTensor
// for a CUDA call (cudaDeviceOf has checked the device; layout strided).
using TensorCheck = void (*)(const char* op, const at::Tensor& t, const char* what);
void checkTensor(const char* op, const at::Tensor& t, const char* what = "tensor");
void checkDeviceTensor(const char* op, const at::Tensor& t, const char* what = "tensor");
// Every tensor passes `checkOne` and has ts[0]'s dtype.
void checkTensors(const char* op, const std::vector<at::Tensor>& ts, const char* what = "tensors",
                  TensorCheck checkOne = checkTensor);
void checkSameDtype(const char* op, const at::Tensor& ref, const at::Tensor& t, const char* what);
void checkNonEmptyList(const char* op, const std::vector<at::Tensor>& ts, const char* what);

// The root's list of a gather (gather_list) or scatter (scatter_list): on the root exactly one
// list of `size` tensors, each passing `checkOne` with `ref`'s dtype and element count (`refName`
// says what ref is); on the other ranks no list. Returns the root's list, empty elsewhere.
std::vector<at::Tensor> rootTensorList(const char* op, const char* listName, const char* refName,
                                       const std::vector<std::vector<at::Tensor>>& lists, const at::Tensor& ref,
                                       int rank, int root, int size, TensorCheck checkOne);

// The (output, input) pairs of all_gather_into_tensor (`outputIsLarge`: output = world size x
// input) or reduce_scatter_tensor (input = world size x output): two non-empty lists of equal
// length, every tensor passing `checkOne`, each pair of one dtype and, with `inputsShareDtype`,
// every input of inputs[0]'s dtype.
void checkFlatPairs(const char* op, const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                    int size, bool outputIsLarge, bool inputsShareDtype, TensorCheck checkOne);

// The tdx dtype for reductions; complex tensors must be viewed as real first (see asReducible).
DataType reduceDtype(const char* op, at::ScalarType st);
// Maps a c10d reduce op, refusing ops undefined for the dtype (BXOR on floats, AVG on ints,
// anything but SUM/AVG on complex). PREMUL_SUM is refused here: the collectives that take it
// read its factor with premulFactor.
ReduceOp toReduceOp(const char* op, const c10d::ReduceOp& rop, at::ScalarType st);
// The factor of a PREMUL_SUM op (torch.distributed._make_nccl_premul_sum(factor)): sum of
// factor * x over ranks. Only for real floating dtypes; a tensor factor must hold one value.
double premulFactor(const char* op, const c10d::ReduceOp& rop, at::ScalarType st);
// Complex tensors become their real view (2x elements); others are returned as they are.
at::Tensor asReducible(const at::Tensor& t);

// A tensor the collectives can read or write in place: the tensor itself when contiguous,
// otherwise a contiguous copy that finish() writes back.
// A 1-D uint8 view sharing storage with a contiguous tensor (moves any dtype as bytes). Built
// directly on the storage: reshape + view through the dispatcher took ~14 us per call on a woken
// 2-core VM, most of a 64 KB cross-host broadcast's overhead over Gloo's own (tensor_utils.cc).
at::Tensor bytesOf(const at::Tensor& t);

// The bytes of elements [offElems, offElems + numel) of a contiguous tensor.
inline Span spanOf(const at::Tensor& t, int64_t offElems, int64_t numel) {
  const size_t esz = t.element_size();
  return Span{static_cast<char*>(t.data_ptr()) + offElems * esz, static_cast<size_t>(numel) * esz};
}

class Staged {
 public:
  // `separate`: a copy even when contiguous (the tensor shares memory with another input).
  explicit Staged(const at::Tensor& t, bool copyIn = true, bool separate = false);
  void* data() const { return work_.data_ptr(); }
  size_t bytes() const { return work_.nbytes(); }
  Span span() const { return Span{static_cast<char*>(data()), bytes()}; }
  const at::Tensor& tensor() const { return work_; }
  void finish();  // copies back into the user's tensor if staged

 private:
  at::Tensor user_;
  at::Tensor work_;
};

// Stages every tensor; finishAll writes back the staged ones. With copyIn, tensors that share
// memory with another input are copied, so that a collective writing one cannot change another's input.
std::vector<Staged> stageAll(const std::vector<at::Tensor>& ts, bool copyIn = true);
void finishAll(std::vector<Staged>& staged);
SpanList spanList(const std::vector<Staged>& staged);
std::vector<Span> spans(const std::vector<Staged>& staged);

// Staged tensors that a collective's body holds alive and writes back after it.
struct StagedSet {
  std::vector<Staged> items;
  std::vector<at::Tensor> tensors() const;  // the contiguous tensors the collective works on
  void finish() { finishAll(items); }
};
std::shared_ptr<StagedSet> stagedSet(const std::vector<at::Tensor>& ts, bool copyIn = true);

}  // namespace tdx
