#include "backend/kernel_ops.h"

#include <c10/util/Exception.h>

#include "kernels/pack_cpu.h"

#ifdef TDX_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "kernels/kernels_cuda.h"
#endif

namespace tdx {

bool builtWithCuda() {
#ifdef TDX_WITH_CUDA
  return true;
#else
  return false;
#endif
}

std::tuple<std::vector<int64_t>, int64_t> flatLayout(const std::vector<int64_t>& numels, int64_t align,
                                                     int64_t divisor) {
  std::vector<int64_t> offsets;
  int64_t total = 0;
  const std::string why = kernels::planLayout(numels, align, divisor, &offsets, &total);
  TORCH_CHECK_VALUE(why.empty(), "tdx flat_layout: ", why);
  return {offsets, total};
}

namespace {

kernels::PackSpec specFor(const char* op, const std::vector<at::Tensor>& tensors, const at::Tensor& flat,
                          const std::vector<int64_t>& offsets, double scale) {
  TORCH_CHECK_VALUE(flat.dim() == 1 && flat.is_contiguous(), "tdx ", op, ": the flat buffer must be a contiguous "
                    "1-D tensor, got shape ", flat.sizes(), flat.is_contiguous() ? "" : " (non-contiguous)");
  TORCH_CHECK_VALUE(offsets.size() == tensors.size(), "tdx ", op, ": ", offsets.size(), " offsets for ",
                    tensors.size(), " tensors; pass one offset per tensor");
  kernels::PackSpec spec;
  spec.offsets = offsets;
  spec.total = flat.numel();
  spec.elemSize = static_cast<int>(flat.element_size());
  spec.floating = flat.scalar_type() == at::kFloat || flat.scalar_type() == at::kDouble;
  spec.scale = static_cast<float>(scale);
  TORCH_CHECK_VALUE(!flat.is_complex(), "tdx ", op, ": complex tensors: pack their torch.view_as_real views");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK_VALUE(t.device() == flat.device(), "tdx ", op, ": tensor ", i, " is on ", t.device(),
                      " but the flat buffer is on ", flat.device(), "; put them on one device");
    TORCH_CHECK_TYPE(t.scalar_type() == flat.scalar_type(), "tdx ", op, ": tensor ", i, " has dtype ",
                     t.scalar_type(), " but the flat buffer has ", flat.scalar_type());
    spec.numels.push_back(t.numel());
  }
  TORCH_CHECK_VALUE(spec.floating || scale == 1.0, "tdx ", op, ": scale ", scale, " needs a float32 or float64 "
                    "buffer, got ", flat.scalar_type());
  const std::string why = kernels::checkSpec(spec);
  TORCH_CHECK_VALUE(why.empty(), "tdx ", op, ": ", why);
  return spec;
}

}  // namespace

void packTensors(const std::vector<at::Tensor>& tensors, at::Tensor& flat, const std::vector<int64_t>& offsets,
                 double scale) {
  const kernels::PackSpec spec = specFor("pack", tensors, flat, offsets, scale);
  std::vector<at::Tensor> contig;
  std::vector<const void*> srcs;
  for (const auto& t : tensors) {
    contig.push_back(t.contiguous());
    srcs.push_back(contig.back().data_ptr());
  }
  if (flat.is_cuda()) {
#ifdef TDX_WITH_CUDA
    c10::cuda::CUDAGuard guard(flat.device());
    kernels::packCuda(spec, srcs, flat.data_ptr(), at::cuda::getCurrentCUDAStream().stream());
    return;
#else
    TORCH_CHECK(false, "tdx pack: this build of tdx has no CUDA kernels (built without nvcc); rebuild with CUDA");
#endif
  }
  TORCH_CHECK_VALUE(flat.is_cpu(), "tdx pack: tensors on ", flat.device(), " are not supported; use CPU or CUDA");
  kernels::packCpu(spec, srcs, flat.data_ptr());
}

void unpackTensors(const at::Tensor& flat, std::vector<at::Tensor>& tensors, const std::vector<int64_t>& offsets) {
  const kernels::PackSpec spec = specFor("unpack", tensors, flat, offsets, 1.0);
  std::vector<void*> dsts;
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK_VALUE(tensors[i].is_contiguous(), "tdx unpack: tensor ", i, " is not contiguous; unpack into a "
                      "contiguous tensor and copy it");
    dsts.push_back(tensors[i].data_ptr());
  }
  if (flat.is_cuda()) {
#ifdef TDX_WITH_CUDA
    c10::cuda::CUDAGuard guard(flat.device());
    kernels::unpackCuda(spec, flat.data_ptr(), dsts, at::cuda::getCurrentCUDAStream().stream());
    return;
#else
    TORCH_CHECK(false, "tdx unpack: this build of tdx has no CUDA kernels (built without nvcc); rebuild with CUDA");
#endif
  }
  TORCH_CHECK_VALUE(flat.is_cpu(), "tdx unpack: tensors on ", flat.device(), " are not supported; use CPU or CUDA");
  kernels::unpackCpu(spec, flat.data_ptr(), dsts);
}

namespace {

void checkCudaFloat(const char* op, const at::Tensor& x, at::ScalarType want) {
  TORCH_CHECK_VALUE(x.is_cuda(), "tdx ", op, ": this kernel runs on CUDA tensors, got one on ", x.device(),
                    "; the CPU loops of the same math are used by the comm hooks");
  TORCH_CHECK_TYPE(x.scalar_type() == want, "tdx ", op, ": expected dtype ", want, ", got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.is_contiguous(), "tdx ", op, ": the tensor must be contiguous; call .contiguous() first");
#ifndef TDX_WITH_CUDA
  TORCH_CHECK(false, "tdx ", op, ": this build of tdx has no CUDA kernels (built without nvcc); rebuild with CUDA");
#endif
}

}  // namespace

at::Tensor compressHalf(const at::Tensor& x, bool bf16) {
  const char* op = bf16 ? "compress_bf16" : "compress_fp16";
  checkCudaFloat(op, x, at::kFloat);
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(bf16 ? at::kBFloat16 : at::kHalf));
#ifdef TDX_WITH_CUDA
  c10::cuda::CUDAGuard guard(x.device());
  auto s = at::cuda::getCurrentCUDAStream().stream();
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  if (bf16) {
    kernels::bf16CompressCuda(x.data_ptr<float>(), o, x.numel(), s);
  } else {
    kernels::fp16CompressCuda(x.data_ptr<float>(), o, x.numel(), s);
  }
#endif
  return out;
}

at::Tensor decompressHalf(const at::Tensor& x) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  checkCudaFloat("decompress", x, bf16 ? at::kBFloat16 : at::kHalf);
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
#ifdef TDX_WITH_CUDA
  c10::cuda::CUDAGuard guard(x.device());
  auto s = at::cuda::getCurrentCUDAStream().stream();
  auto* in = reinterpret_cast<const uint16_t*>(x.data_ptr());
  if (bf16) {
    kernels::bf16DecompressCuda(in, out.data_ptr<float>(), x.numel(), s);
  } else {
    kernels::fp16DecompressCuda(in, out.data_ptr<float>(), x.numel(), s);
  }
#endif
  return out;
}

std::tuple<at::Tensor, at::Tensor> int8Quantize(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                int64_t block) {
  checkCudaFloat("int8_quantize", x, at::kFloat);
  TORCH_CHECK_VALUE(block >= 1 && block <= (1 << 20), "tdx int8_quantize: block must be in [1, 2^20], got ", block);
  if (residual.has_value()) {
    checkCudaFloat("int8_quantize (residual)", *residual, at::kFloat);
    TORCH_CHECK_VALUE(residual->numel() == x.numel() && residual->device() == x.device(), "tdx int8_quantize: the "
                      "residual has ", residual->numel(), " elements on ", residual->device(), " but the input has ",
                      x.numel(), " on ", x.device());
  }
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({(x.numel() + block - 1) / block}, x.options());
#ifdef TDX_WITH_CUDA
  c10::cuda::CUDAGuard guard(x.device());
  kernels::int8QuantizeCuda(x.data_ptr<float>(), residual.has_value() ? residual->data_ptr<float>() : nullptr,
                            x.numel(), static_cast<int>(block), q.data_ptr<int8_t>(), scales.data_ptr<float>(),
                            at::cuda::getCurrentCUDAStream().stream());
#endif
  return {q, scales};
}

void int8Dequantize(const at::Tensor& q, const at::Tensor& scales, int64_t block, at::Tensor& out, bool accumulate) {
  checkCudaFloat("int8_dequantize", out, at::kFloat);
  TORCH_CHECK_TYPE(q.scalar_type() == at::kChar, "tdx int8_dequantize: q must be int8, got ", q.scalar_type());
  TORCH_CHECK_VALUE(q.is_cuda() && scales.is_cuda() && q.is_contiguous() && scales.is_contiguous(),
                    "tdx int8_dequantize: q and scales must be contiguous CUDA tensors");
  TORCH_CHECK_VALUE(block >= 1, "tdx int8_dequantize: block must be >= 1, got ", block);
  TORCH_CHECK_VALUE(q.numel() == out.numel() && scales.numel() == (q.numel() + block - 1) / block,
                    "tdx int8_dequantize: q has ", q.numel(), " elements, out ", out.numel(), ", scales ",
                    scales.numel(), " (expected ", (q.numel() + block - 1) / block, " for block ", block, ")");
#ifdef TDX_WITH_CUDA
  c10::cuda::CUDAGuard guard(out.device());
  kernels::int8DequantizeCuda(q.data_ptr<int8_t>(), scales.data_ptr<float>(), q.numel(), static_cast<int>(block),
                              out.data_ptr<float>(), accumulate, at::cuda::getCurrentCUDAStream().stream());
#endif
}

}  // namespace tdx
