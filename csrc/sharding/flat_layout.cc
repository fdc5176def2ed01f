#include "sharding/flat_layout.h"

#include "common/logging.h"
#include "common/round_up.h"

namespace tdx {

FlatLayout makeFlatLayout(const std::vector<int64_t>& numels, const FlatLayoutOptions& options) {
  TDX_ENFORCE(options.alignment >= 1, "flat layout: alignment must be >= 1 element, got ", options.alignment);
  TDX_ENFORCE(options.worldSize >= 1, "flat layout: world size must be >= 1, got ", options.worldSize);
  FlatLayout l;
  l.alignment = options.alignment;
  l.worldSize = options.worldSize;
  l.numels = numels;
  int64_t end = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    TDX_ENFORCE(numels[i] >= 0, "flat layout: parameter ", i, " has numel ", numels[i], " (must be >= 0)");
    const int64_t off = roundUp(end, options.alignment);
    l.offsets.push_back(off);
    end = off + numels[i];
  }
  l.unpaddedNumel = end;
  // At least one aligned element per rank, so every shard is a real (non-empty) tensor.
  l.paddedNumel = roundUp(end > 0 ? end : 1, options.worldSize * options.alignment);
  l.shardNumel = l.paddedNumel / options.worldSize;
  return l;
}

std::vector<int64_t> splitSizes(const FlatLayout& layout) {
  if (layout.numels.empty()) return {layout.paddedNumel};
  std::vector<int64_t> sizes;
  sizes.reserve(2 * layout.numels.size());
  for (size_t i = 0; i < layout.numels.size(); ++i) {
    const int64_t end = layout.offsets[i] + layout.numels[i];
    const int64_t next = i + 1 < layout.numels.size() ? layout.offsets[i + 1] : layout.paddedNumel;
    sizes.push_back(layout.numels[i]);
    sizes.push_back(next - end);  // alignment gap after parameter i (the tail padding after the last)
  }
  return sizes;
}

}  // namespace tdx
