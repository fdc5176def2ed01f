// Fused multi-tensor pack/unpack kernels: one launch moves up to kBatch entries (and the padding
// between them); blockIdx.y picks the entry, the x dimension strides over it. The per-element
// work is packChunk / unpackChunk from pack_math.h, the functions the CPU tests exercise.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "common/logging.h"
#include "kernels/kernels_cuda.h"
#include "kernels/pack_math.h"

namespace tdx {
namespace kernels {

namespace {

constexpr int kBatch = 32;
constexpr int kThreads = 256;

template <typename T>
struct Batch {
  const T* srcs[kBatch];   // pack: source of entry e (nullptr: a padding range, zero-filled)
  T* dsts[kBatch];         // unpack: destination of entry e
  int64_t offsets[kBatch]; // flat offset of entry e, in elements of T
  int64_t numels[kBatch];
  int n;
};

template <typename T>
__global__ void packKernel(Batch<T> b, T* flat, float scale) {
  const int e = blockIdx.y;
  const PackChunk c{b.srcs[e] ? e : -1, b.offsets[e], b.numels[e]};
  packChunk<T>(b.srcs, b.offsets, flat, c, scale, static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
               static_cast<int64_t>(gridDim.x) * blockDim.x);
}

template <typename T>
__global__ void unpackKernel(Batch<T> b, const T* flat) {
  const int e = blockIdx.y;
  const PackChunk c{e, b.offsets[e], b.numels[e]};
  unpackChunk<T>(b.dsts, b.offsets, flat, c, static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                 static_cast<int64_t>(gridDim.x) * blockDim.x);
}

void checkLaunch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  TDX_ENFORCE(e == cudaSuccess, what, " kernel launch failed: ", cudaGetErrorString(e));
}

int smCount() {
  static const int n = [] {
    int dev = 0, sms = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    return sms > 0 ? sms : 80;
  }();
  return n;
}

// A range of the flat buffer: an entry (index into the caller's lists) or padding (-1).
struct Range {
  int entry;
  int64_t offset;
  int64_t numel;
};

std::vector<Range> rangesOf(const PackSpec& spec, bool withPadding) {
  std::vector<Range> r;
  int64_t pos = 0;
  for (size_t i = 0; i < spec.offsets.size(); ++i) {
    if (withPadding && spec.offsets[i] > pos) r.push_back({-1, pos, spec.offsets[i] - pos});
    if (spec.numels[i] > 0) r.push_back({static_cast<int>(i), spec.offsets[i], spec.numels[i]});
    pos = spec.offsets[i] + spec.numels[i];
  }
  if (withPadding && spec.total > pos) r.push_back({-1, pos, spec.total - pos});
  return r;
}

// Cuts `ranges` into batches of up to kBatch ranges in units of W (offsets and lengths divided by
// `ratio`): point(b, j, range) sets range j's pointer, launch(b, grid) starts the batch's kernel.
template <typename W, typename Point, typename Launch>
void forEachBatch(const std::vector<Range>& ranges, int64_t ratio, Point&& point, Launch&& launch) {
  for (size_t first = 0; first < ranges.size(); first += kBatch) {
    Batch<W> b{};
    b.n = static_cast<int>(std::min<size_t>(kBatch, ranges.size() - first));
    int64_t longest = 0;
    for (int j = 0; j < b.n; ++j) {
      const Range& r = ranges[first + j];
      point(b, j, r);
      b.offsets[j] = r.offset / ratio;
      b.numels[j] = r.numel / ratio;
      longest = std::max(longest, b.numels[j]);
    }
    const int64_t want = (longest + kThreads - 1) / kThreads;
    const int gx = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, 4LL * smCount() / b.n + 1)));
    launch(b, dim3(gx, b.n));
  }
}

// Copies in units of W (W = T, or 16-byte words when every pointer and length allows it).
template <typename W>
void launchPack(const std::vector<Range>& ranges, const std::vector<const void*>& srcs, void* flat, int64_t ratio,
                float scale, cudaStream_t stream) {
  forEachBatch<W>(
      ranges, ratio,
      [&](Batch<W>& b, int j, const Range& r) {
        b.srcs[j] = r.entry < 0 ? nullptr : static_cast<const W*>(srcs[r.entry]);
      },
      [&](const Batch<W>& b, dim3 grid) {
        packKernel<W><<<grid, kThreads, 0, stream>>>(b, static_cast<W*>(flat), scale);
        checkLaunch("pack");
      });
}

template <typename W>
void launchUnpack(const std::vector<Range>& ranges, const void* flat, const std::vector<void*>& dsts, int64_t ratio,
                  cudaStream_t stream) {
  forEachBatch<W>(
      ranges, ratio, [&](Batch<W>& b, int j, const Range& r) { b.dsts[j] = static_cast<W*>(dsts[r.entry]); },
      [&](const Batch<W>& b, dim3 grid) {
        unpackKernel<W><<<grid, kThreads, 0, stream>>>(b, static_cast<const W*>(flat));
        checkLaunch("unpack");
      });
}

// How many elements make a 16-byte word, when every range and pointer is 16-byte aligned; else 1.
template <typename P>
int64_t wordRatio(const PackSpec& spec, const std::vector<Range>& ranges, const std::vector<P>& ptrs,
                  const void* flat) {
  const int64_t ratio = 16 / spec.elemSize;
  if (reinterpret_cast<uintptr_t>(flat) % 16) return 1;
  for (const Range& r : ranges) {
    if (r.offset % ratio || r.numel % ratio) return 1;
    if (r.entry >= 0 && reinterpret_cast<uintptr_t>(ptrs[r.entry]) % 16) return 1;
  }
  return ratio;
}

void enforce(const PackSpec& spec, size_t pointers) {
  std::string why = checkSpec(spec);
  if (why.empty() && pointers != spec.numels.size()) {
    why = std::to_string(pointers) + " tensors for " + std::to_string(spec.numels.size()) + " entries";
  }
  TDX_ENFORCE(why.empty(), "pack/unpack: ", why);
}

}  // namespace

void packCuda(const PackSpec& spec, const std::vector<const void*>& srcs, void* flat, cudaStream_t stream) {
  enforce(spec, srcs.size());
  const auto ranges = rangesOf(spec, /*withPadding=*/true);
  if (ranges.empty()) return;
  const bool scaled = spec.floating && spec.scale != 1.0f;
  if (!scaled && wordRatio(spec, ranges, srcs, flat) > 1) {
    return launchPack<uint4>(ranges, srcs, flat, 16 / spec.elemSize, 1.0f, stream);
  }
  switch (spec.elemSize) {
    case 1: return launchPack<uint8_t>(ranges, srcs, flat, 1, 1.0f, stream);
    case 2: return launchPack<uint16_t>(ranges, srcs, flat, 1, 1.0f, stream);
    case 4:
      return spec.floating ? launchPack<float>(ranges, srcs, flat, 1, spec.scale, stream)
                           : launchPack<uint32_t>(ranges, srcs, flat, 1, 1.0f, stream);
    default:
      return spec.floating ? launchPack<double>(ranges, srcs, flat, 1, spec.scale, stream)
                           : launchPack<uint64_t>(ranges, srcs, flat, 1, 1.0f, stream);
  }
}

void unpackCuda(const PackSpec& spec, const void* flat, const std::vector<void*>& dsts, cudaStream_t stream) {
  enforce(spec, dsts.size());
  const auto ranges = rangesOf(spec, /*withPadding=*/false);
  if (ranges.empty()) return;
  if (wordRatio(spec, ranges, dsts, flat) > 1) {
    return launchUnpack<uint4>(ranges, flat, dsts, 16 / spec.elemSize, stream);
  }
  switch (spec.elemSize) {
    case 1: return launchUnpack<uint8_t>(ranges, flat, dsts, 1, stream);
    case 2: return launchUnpack<uint16_t>(ranges, flat, dsts, 1, stream);
    case 4: return launchUnpack<uint32_t>(ranges, flat, dsts, 1, stream);
    default: return launchUnpack<uint64_t>(ranges, flat, dsts, 1, stream);
  }
}

}  // namespace kernels
}  // namespace tdx
