#include "backend/kernel_ops.h"

#include <c10/util/Exception.h>

#include "backend/cuda_registry.h"

namespace tdx {

bool builtWithCuda() { return cudaRegistration() != nullptr; }

namespace {

const CudaRegistration& checkCudaFloat(const char* op, const at::Tensor& x, at::ScalarType want) {
  TORCH_CHECK_VALUE(x.is_cuda(), "tdx ", op, ": this kernel runs on CUDA tensors, got one on ", x.device(),
                    "; the CPU loops of the same math are used by the comm hooks");
  TORCH_CHECK_TYPE(x.scalar_type() == want, "tdx ", op, ": expected dtype ", want, ", got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.is_contiguous(), "tdx ", op, ": the tensor must be contiguous; call .contiguous() first");
  TORCH_CHECK(cudaRegistration(), "tdx ", op, ": this build of tdx has no CUDA kernels (built without nvcc); rebuild "
              "with CUDA");
  return *cudaRegistration();
}

}  // namespace

at::Tensor compressHalf(const at::Tensor& x, bool bf16) {
  const auto& cuda = checkCudaFloat(bf16 ? "compress_bf16" : "compress_fp16", x, at::kFloat);
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(bf16 ? at::kBFloat16 : at::kHalf));
  cuda.compressHalf(x, out);
  return out;
}

at::Tensor decompressHalf(const at::Tensor& x) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const auto& cuda = checkCudaFloat("decompress", x, bf16 ? at::kBFloat16 : at::kHalf);
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  cuda.decompressHalf(x, out);
  return out;
}

std::tuple<at::Tensor, at::Tensor> int8Quantize(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                int64_t block) {
  const auto& cuda = checkCudaFloat("int8_quantize", x, at::kFloat);
  TORCH_CHECK_VALUE(block >= 1 && block <= (1 << 20), "tdx int8_quantize: block must be in [1, 2^20], got ", block);
  if (residual.has_value()) {
    checkCudaFloat("int8_quantize (residual)", *residual, at::kFloat);
    TORCH_CHECK_VALUE(residual->numel() == x.numel() && residual->device() == x.device(), "tdx int8_quantize: the "
                      "residual has ", residual->numel(), " elements on ", residual->device(), " but the input has ",
                      x.numel(), " on ", x.device());
  }
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({(x.numel() + block - 1) / block}, x.options());
  cuda.int8Quantize(x, residual.value_or(at::Tensor()), block, q, scales);
  return {q, scales};
}

void int8Dequantize(const at::Tensor& q, const at::Tensor& scales, int64_t block, at::Tensor& out, bool accumulate) {
  const auto& cuda = checkCudaFloat("int8_dequantize", out, at::kFloat);
  TORCH_CHECK_TYPE(q.scalar_type() == at::kChar, "tdx int8_dequantize: q must be int8, got ", q.scalar_type());
  TORCH_CHECK_VALUE(q.is_cuda() && scales.is_cuda() && q.is_contiguous() && scales.is_contiguous(),
                    "tdx int8_dequantize: q and scales must be contiguous CUDA tensors");
  TORCH_CHECK_VALUE(block >= 1, "tdx int8_dequantize: block must be >= 1, got ", block);
  TORCH_CHECK_VALUE(q.numel() == out.numel() && scales.numel() == (q.numel() + block - 1) / block,
                    "tdx int8_dequantize: q has ", q.numel(), " elements, out ", out.numel(), ", scales ",
                    scales.numel(), " (expected ", (q.numel() + block - 1) / block, " for block ", block, ")");
  cuda.int8Dequantize(q, scales, block, out, accumulate);
}

}  // namespace tdx
