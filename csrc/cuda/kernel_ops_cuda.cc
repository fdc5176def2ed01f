// Tensor-level launchers of compress.cu on the current stream of the tensors' device.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/cuda_entry.h"
#include "cuda/kernels_cuda.h"

namespace tdx {

namespace {

cudaStream_t streamOf(const at::Tensor& t) { return at::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

}  // namespace

void compressHalfCuda(const at::Tensor& in, const at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(in.device());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  if (out.scalar_type() == at::kBFloat16) {
    kernels::bf16CompressCuda(in.data_ptr<float>(), o, in.numel(), streamOf(in));
  } else {
    kernels::fp16CompressCuda(in.data_ptr<float>(), o, in.numel(), streamOf(in));
  }
}

void decompressHalfCuda(const at::Tensor& in, const at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(in.device());
  const auto* i = reinterpret_cast<const uint16_t*>(in.data_ptr());
  if (in.scalar_type() == at::kBFloat16) {
    kernels::bf16DecompressCuda(i, out.data_ptr<float>(), in.numel(), streamOf(in));
  } else {
    kernels::fp16DecompressCuda(i, out.data_ptr<float>(), in.numel(), streamOf(in));
  }
}

void int8QuantizeCuda(const at::Tensor& x, const at::Tensor& residual, int64_t block, const at::Tensor& q,
                      const at::Tensor& scales) {
  const c10::cuda::CUDAGuard guard(x.device());
  kernels::int8QuantizeCuda(x.data_ptr<float>(), residual.defined() ? residual.data_ptr<float>() : nullptr, x.numel(),
                            static_cast<int>(block), static_cast<int8_t*>(q.data_ptr()),
                            static_cast<float*>(scales.data_ptr()), streamOf(x));
}

void int8DequantizeCuda(const at::Tensor& q, const at::Tensor& scales, int64_t block, const at::Tensor& out,
                        bool accumulate) {
  const c10::cuda::CUDAGuard guard(out.device());
  kernels::int8DequantizeCuda(static_cast<const int8_t*>(q.data_ptr()), static_cast<const float*>(scales.data_ptr()),
                              out.numel(), static_cast<int>(block), out.data_ptr<float>(), accumulate, streamOf(out));
}

}  // namespace tdx
