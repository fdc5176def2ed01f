// Gradient compression kernels: bf16 / fp16 casts and blockwise int8 quantization with error
// feedback. The element math is compress_math.h's (shared with compress_cpu.cc, which the CPU
// tests check against float64 references); here it only runs in parallel.
#include <cuda_runtime.h>

#include <algorithm>

#include "common/logging.h"
#include "kernels/compress_math.h"
#include "cuda/kernels_cuda.h"

namespace tdx {
namespace kernels {

namespace {

constexpr int kThreads = 256;

void checkLaunch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  TDX_ENFORCE(e == cudaSuccess, what, " kernel launch failed: ", cudaGetErrorString(e));
}

int gridFor(int64_t work) {
  static const int sms = [] {
    int dev = 0, n = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    return n > 0 ? n : 80;
  }();
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, 8LL * sms)));
}

// Four elements per thread and step when both pointers are aligned for it, the rest one by one.
// kBf16 picks bfloat16 or IEEE half, in both directions.
template <bool kBf16>
__device__ __forceinline__ uint16_t toHalfBits(float v) {
  return kBf16 ? floatToBf16(v) : floatToHalf(v);
}

template <bool kBf16>
__global__ void toHalfKernel(const float* in, uint16_t* out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool vec = (reinterpret_cast<uintptr_t>(in) % 16 == 0) && (reinterpret_cast<uintptr_t>(out) % 8 == 0);
  int64_t done = 0;
  if (vec) {
    const int64_t n4 = n / 4;
    for (int64_t i = tid; i < n4; i += stride) {
      const float4 v = reinterpret_cast<const float4*>(in)[i];
      ushort4 o;
      o.x = toHalfBits<kBf16>(v.x);
      o.y = toHalfBits<kBf16>(v.y);
      o.z = toHalfBits<kBf16>(v.z);
      o.w = toHalfBits<kBf16>(v.w);
      reinterpret_cast<ushort4*>(out)[i] = o;
    }
    done = n4 * 4;
  }
  for (int64_t i = done + tid; i < n; i += stride) out[i] = toHalfBits<kBf16>(in[i]);
}

template <bool kBf16>
__global__ void fromHalfKernel(const uint16_t* in, float* out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool vec = (reinterpret_cast<uintptr_t>(in) % 8 == 0) && (reinterpret_cast<uintptr_t>(out) % 16 == 0);
  int64_t done = 0;
  if (vec) {
    const int64_t n4 = n / 4;
    for (int64_t i = tid; i < n4; i += stride) {
      const ushort4 v = reinterpret_cast<const ushort4*>(in)[i];
      float4 o;
      o.x = kBf16 ? bf16ToFloat(v.x) : halfToFloat(v.x);
      o.y = kBf16 ? bf16ToFloat(v.y) : halfToFloat(v.y);
      o.z = kBf16 ? bf16ToFloat(v.z) : halfToFloat(v.z);
      o.w = kBf16 ? bf16ToFloat(v.w) : halfToFloat(v.w);
      reinterpret_cast<float4*>(out)[i] = o;
    }
    done = n4 * 4;
  }
  for (int64_t i = done + tid; i < n; i += stride) out[i] = kBf16 ? bf16ToFloat(in[i]) : halfToFloat(in[i]);
}

// The block's max |c| with compress_cpu's rule: a NaN wins (makes the scale NaN).
__device__ __forceinline__ float absmaxCombine(float m, float a) { return (a > m || a != a) ? a : m; }

// One thread block per quantization block: c = in + residual, scale, q, new residual.
__global__ void int8QuantizeKernel(const float* in, float* residual, int64_t n, int block, int8_t* q, float* scales) {
  __shared__ float partial[kThreads / 32];
  const int64_t nblocks = (n + block - 1) / block;
  for (int64_t b = blockIdx.x; b < nblocks; b += gridDim.x) {
    const int64_t begin = b * block;
    const int64_t end = begin + block < n ? begin + block : n;
    float m = 0.0f;
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      const float c = residual ? in[i] + residual[i] : in[i];
      m = absmaxCombine(m, fabsf(c));
    }
    for (int off = 16; off > 0; off /= 2) m = absmaxCombine(m, __shfl_down_sync(0xffffffffu, m, off));
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x / 32] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
      float all = 0.0f;
      for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) all = absmaxCombine(all, partial[w]);
      partial[0] = all;
    }
    __syncthreads();
    const float scale = int8Scale(partial[0]);
    __syncthreads();  // partial[] is reused by the next block
    if (threadIdx.x == 0) scales[b] = scale;
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      const float c = residual ? in[i] + residual[i] : in[i];
      const int8_t v = quantizeInt8(c, scale);
      q[i] = v;
      if (residual) residual[i] = c - dequantizeInt8(v, scale);
    }
  }
}

__global__ void int8DequantizeKernel(const int8_t* q, const float* scales, int64_t n, int block, float* out,
                                    bool accumulate) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float v = dequantizeInt8(q[i], scales[i / block]);
    out[i] = accumulate ? out[i] + v : v;
  }
}

}  // namespace

void bf16CompressCuda(const float* in, uint16_t* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  toHalfKernel<true><<<gridFor(n / 4 + 1), kThreads, 0, stream>>>(in, out, n);
  checkLaunch("bf16 compress");
}

void bf16DecompressCuda(const uint16_t* in, float* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  fromHalfKernel<true><<<gridFor(n / 4 + 1), kThreads, 0, stream>>>(in, out, n);
  checkLaunch("bf16 decompress");
}

void fp16CompressCuda(const float* in, uint16_t* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  toHalfKernel<false><<<gridFor(n / 4 + 1), kThreads, 0, stream>>>(in, out, n);
  checkLaunch("fp16 compress");
}

void fp16DecompressCuda(const uint16_t* in, float* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  fromHalfKernel<false><<<gridFor(n / 4 + 1), kThreads, 0, stream>>>(in, out, n);
  checkLaunch("fp16 decompress");
}

void int8QuantizeCuda(const float* in, float* residual, int64_t n, int block, int8_t* q, float* scales,
                      cudaStream_t stream) {
  TDX_ENFORCE(block >= 1, "int8 quantization: block must be >= 1, got ", block);
  if (n == 0) return;
  const int64_t nblocks = (n + block - 1) / block;
  const int grid = static_cast<int>(std::min<int64_t>(nblocks, 65535));
  int8QuantizeKernel<<<grid, kThreads, 0, stream>>>(in, residual, n, block, q, scales);
  checkLaunch("int8 quantize");
}

void int8DequantizeCuda(const int8_t* q, const float* scales, int64_t n, int block, float* out, bool accumulate,
                        cudaStream_t stream) {
  TDX_ENFORCE(block >= 1, "int8 dequantization: block must be >= 1, got ", block);
  if (n == 0) return;
  int8DequantizeKernel<<<gridFor(n), kThreads, 0, stream>>>(q, scales, n, block, out, accumulate);
  checkLaunch("int8 dequantize");
}

}  // namespace kernels
}  // namespace tdx
