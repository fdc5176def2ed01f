// What csrc/cuda offers the rest of tdx, all of it through cudaRegistration() (register.cc).
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>

#include "backend/cuda_registry.h"

namespace tdx {

std::string gpuIdentity(int device);  // nccl_path.cc
std::unique_ptr<DeviceEngine> makeNcclEngine(c10::intrusive_ptr<c10d::Store> store, const GroupInfo& info,
                                             at::Device device);  // nccl_engine.cc

// kernel_ops_cuda.cc: the launchers of compress.cu on tensors (see CudaRegistration).
void compressHalfCuda(const at::Tensor& in, const at::Tensor& out);
void decompressHalfCuda(const at::Tensor& in, const at::Tensor& out);
void int8QuantizeCuda(const at::Tensor& x, const at::Tensor& residual, int64_t block, const at::Tensor& q,
                      const at::Tensor& scales);
void int8DequantizeCuda(const at::Tensor& q, const at::Tensor& scales, int64_t block, const at::Tensor& out,
                        bool accumulate);

}  // namespace tdx
