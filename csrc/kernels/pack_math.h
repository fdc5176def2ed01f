// Fused multi-tensor pack/unpack: the math shared by the CPU loops (pack_cpu.cc) and the CUDA
// kernels (pack.cu). No torch includes; compiles as plain C++17 and under nvcc.
//
// A flat buffer (a DDP bucket, an FSDP flat parameter) holds `n` entries of one element type:
// entry i occupies elements [offsets[i], offsets[i] + numels[i]); every other element of the
// buffer (alignment gaps, the padding that makes it divisible by the world size) is padding,
// written as zero by pack and ignored by unpack. Work is cut into chunks that never cross an
// entry boundary, so a GPU block copies one contiguous range and the CPU loop runs the very same
// per-chunk function with one lane.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#ifndef TDX_HD  // the same definition as compress_math.h
#if defined(__CUDACC__)
#define TDX_HD __host__ __device__ __forceinline__
#else
#define TDX_HD inline
#endif
#endif

namespace tdx {
namespace kernels {

// One chunk of a pack/unpack: flat elements [flatBegin, flatBegin + count); entry -1 = padding.
struct PackChunk {
  int32_t entry;
  int64_t flatBegin;
  int64_t count;
};

// Rounds x up to a multiple of a (a >= 1).
TDX_HD int64_t alignUp(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// The entry holding flat element `flat`, or -1 for padding (binary search; offsets ascending).
TDX_HD int32_t findEntry(const int64_t* offsets, const int64_t* numels, int32_t n, int64_t flat) {
  int32_t lo = 0, hi = n;  // first entry with offset > flat is `lo` after the loop
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo) / 2;
    if (offsets[mid] <= flat) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  const int32_t e = lo - 1;
  return (e >= 0 && flat < offsets[e] + numels[e]) ? e : -1;
}

// Pack element: the value written to the flat buffer for source value x (scale applied to
// floating types only; integers are copied as they are). Unpack is the identity.
template <typename T>
TDX_HD T packValue(T x, float scale) {
  return x;
}
template <>
TDX_HD float packValue<float>(float x, float scale) {
  return scale == 1.0f ? x : x * scale;
}
template <>
TDX_HD double packValue<double>(double x, float scale) {
  return scale == 1.0f ? x : x * static_cast<double>(scale);
}

// Copies lanes `lane, lane + lanes, ...` of one pack chunk: srcs[entry] -> flat (scaled), or
// zeros for a padding chunk. The CPU runs it with lane 0 of 1; a CUDA block with its threads.
template <typename T>
TDX_HD void packChunk(const T* const* srcs, const int64_t* offsets, T* flat, const PackChunk& c, float scale,
                      int64_t lane, int64_t lanes) {
  T* out = flat + c.flatBegin;
  if (c.entry < 0) {
    for (int64_t i = lane; i < c.count; i += lanes) out[i] = T{};
    return;
  }
  const T* in = srcs[c.entry] + (c.flatBegin - offsets[c.entry]);
  for (int64_t i = lane; i < c.count; i += lanes) out[i] = packValue<T>(in[i], scale);
}

// Copies lanes of one unpack chunk: flat -> dsts[entry]; padding chunks are skipped.
template <typename T>
TDX_HD void unpackChunk(T* const* dsts, const int64_t* offsets, const T* flat, const PackChunk& c, int64_t lane,
                        int64_t lanes) {
  if (c.entry < 0) return;
  const T* in = flat + c.flatBegin;
  T* out = dsts[c.entry] + (c.flatBegin - offsets[c.entry]);
  for (int64_t i = lane; i < c.count; i += lanes) out[i] = in[i];
}

// Host-side planning (not device code).

// Offsets of `numels` laid out one after another, each starting at a multiple of `align`
// elements; `total` is the end of the last entry rounded up to a multiple of `divisor`
// (FSDP: the world size, so every rank's shard has the same length). Returns an empty string,
// or what was wrong with the arguments.
inline std::string planLayout(const std::vector<int64_t>& numels, int64_t align, int64_t divisor,
                              std::vector<int64_t>* offsets, int64_t* total) {
  if (align < 1) return "align must be >= 1, got " + std::to_string(align);
  if (divisor < 1) return "divisor must be >= 1, got " + std::to_string(divisor);
  offsets->clear();
  int64_t pos = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    if (numels[i] < 0) return "entry " + std::to_string(i) + " has a negative size " + std::to_string(numels[i]);
    pos = alignUp(pos, align);
    offsets->push_back(pos);
    pos += numels[i];
  }
  *total = alignUp(pos, divisor);
  return "";
}

// Checks that entries lie inside [0, total), ascend and do not overlap; returns "" or the reason.
inline std::string checkLayout(const std::vector<int64_t>& offsets, const std::vector<int64_t>& numels,
                               int64_t total) {
  if (offsets.size() != numels.size()) {
    return std::to_string(offsets.size()) + " offsets for " + std::to_string(numels.size()) + " entries";
  }
  int64_t end = 0;
  for (size_t i = 0; i < offsets.size(); ++i) {
    if (numels[i] < 0) return "entry " + std::to_string(i) + " has a negative size";
    if (offsets[i] < end) {
      return "entry " + std::to_string(i) + " starts at element " + std::to_string(offsets[i]) +
             ", before the end of the previous entry (" + std::to_string(end) + ")";
    }
    end = offsets[i] + numels[i];
  }
  if (end > total) {
    return "the entries end at element " + std::to_string(end) + " but the flat buffer has only " +
           std::to_string(total);
  }
  return "";
}

// Cuts [0, total) into chunks of at most `chunkElems` elements that never cross an entry or
// padding boundary, in flat order. With `withPadding` false, padding chunks are left out.
inline std::vector<PackChunk> planChunks(const std::vector<int64_t>& offsets, const std::vector<int64_t>& numels,
                                         int64_t total, int64_t chunkElems, bool withPadding) {
  std::vector<PackChunk> chunks;
  auto add = [&](int32_t entry, int64_t begin, int64_t end) {
    if (entry < 0 && !withPadding) return;
    for (int64_t b = begin; b < end; b += chunkElems) {
      chunks.push_back(PackChunk{entry, b, (end - b) < chunkElems ? (end - b) : chunkElems});
    }
  };
  int64_t pos = 0;
  for (size_t i = 0; i < offsets.size(); ++i) {
    add(-1, pos, offsets[i]);
    add(static_cast<int32_t>(i), offsets[i], offsets[i] + numels[i]);
    pos = offsets[i] + numels[i];
  }
  add(-1, pos, total);
  return chunks;
}

}  // namespace kernels
}  // namespace tdx
