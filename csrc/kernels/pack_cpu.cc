#include "kernels/pack_cpu.h"

#include <stdexcept>

namespace tdx {
namespace kernels {

namespace {

template <typename T>
void packTyped(const PackSpec& spec, const std::vector<const void*>& srcs, void* flat) {
  std::vector<const T*> typed;
  for (const void* p : srcs) typed.push_back(static_cast<const T*>(p));
  for (const PackChunk& c : planChunks(spec.offsets, spec.numels, spec.total, spec.chunkElems, true)) {
    packChunk<T>(typed.data(), spec.offsets.data(), static_cast<T*>(flat), c, spec.scale, 0, 1);
  }
}

template <typename T>
void unpackTyped(const PackSpec& spec, const void* flat, const std::vector<void*>& dsts) {
  std::vector<T*> typed;
  for (void* p : dsts) typed.push_back(static_cast<T*>(p));
  for (const PackChunk& c : planChunks(spec.offsets, spec.numels, spec.total, spec.chunkElems, false)) {
    unpackChunk<T>(typed.data(), spec.offsets.data(), static_cast<const T*>(flat), c, 0, 1);
  }
}

void enforce(const PackSpec& spec, size_t pointers) {
  std::string why = checkSpec(spec);
  if (why.empty() && pointers != spec.numels.size()) {
    why = std::to_string(pointers) + " tensors for " + std::to_string(spec.numels.size()) + " entries";
  }
  if (!why.empty()) throw std::invalid_argument("tdx pack/unpack: " + why);
}

}  // namespace

std::string checkSpec(const PackSpec& spec) {
  if (spec.elemSize != 1 && spec.elemSize != 2 && spec.elemSize != 4 && spec.elemSize != 8) {
    return "element size " + std::to_string(spec.elemSize) + " is not 1, 2, 4 or 8 bytes";
  }
  if (spec.floating && spec.elemSize < 4) {
    return "floating packing (with a scale) supports float32 and float64 only, got " +
           std::to_string(spec.elemSize) + "-byte elements";
  }
  if (!spec.floating && spec.scale != 1.0f) {
    return "a scale other than 1 (" + std::to_string(spec.scale) + ") needs float32 or float64 elements";
  }
  if (spec.chunkElems < 1) return "chunkElems must be >= 1";
  return checkLayout(spec.offsets, spec.numels, spec.total);
}

void packCpu(const PackSpec& spec, const std::vector<const void*>& srcs, void* flat) {
  enforce(spec, srcs.size());
  switch (spec.elemSize) {
    case 1: return packTyped<uint8_t>(spec, srcs, flat);
    case 2: return packTyped<uint16_t>(spec, srcs, flat);
    case 4: return spec.floating ? packTyped<float>(spec, srcs, flat) : packTyped<uint32_t>(spec, srcs, flat);
    default: return spec.floating ? packTyped<double>(spec, srcs, flat) : packTyped<uint64_t>(spec, srcs, flat);
  }
}

void unpackCpu(const PackSpec& spec, const void* flat, const std::vector<void*>& dsts) {
  enforce(spec, dsts.size());
  switch (spec.elemSize) {
    case 1: return unpackTyped<uint8_t>(spec, flat, dsts);
    case 2: return unpackTyped<uint16_t>(spec, flat, dsts);
    case 4: return unpackTyped<uint32_t>(spec, flat, dsts);
    default: return unpackTyped<uint64_t>(spec, flat, dsts);
  }
}

}  // namespace kernels
}  // namespace tdx
