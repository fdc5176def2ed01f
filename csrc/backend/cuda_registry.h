// What csrc/cuda (compiled only when the build has CUDA) registers at static initialization: the
// NCCL engine for the route table and the tensor-level CUDA kernels. Elsewhere, code asks
// cudaRegistration() instead of testing a build macro; it is null in a build without CUDA.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>
#include <string>

#include "backend/engine.h"
#include "transport/transport.h"

namespace tdx {

struct CudaRegistration {
  std::string (*gpuIdentity)(int device) = nullptr;  // the device's UUID or PCI bus id
  std::unique_ptr<DeviceEngine> (*makeEngine)(c10::intrusive_ptr<c10d::Store> store, const GroupInfo& info,
                                              at::Device device) = nullptr;
  // Kernels on the current stream of the tensors' device; arguments are contiguous and checked.
  void (*compressHalf)(const at::Tensor& in, const at::Tensor& out) = nullptr;    // float32 -> out's bf16 / fp16
  void (*decompressHalf)(const at::Tensor& in, const at::Tensor& out) = nullptr;  // bf16 / fp16 -> float32
  // q = quantize(x + residual) per block (residual may be undefined; else it becomes the error).
  void (*int8Quantize)(const at::Tensor& x, const at::Tensor& residual, int64_t block, const at::Tensor& q,
                       const at::Tensor& scales) = nullptr;
  void (*int8Dequantize)(const at::Tensor& q, const at::Tensor& scales, int64_t block, const at::Tensor& out,
                         bool accumulate) = nullptr;
};
bool registerCuda(CudaRegistration registration);  // returns true, for a static initializer
const CudaRegistration* cudaRegistration();        // null in a build without CUDA

}  // namespace tdx
