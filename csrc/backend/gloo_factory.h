// Where the Gloo groups of a group spanning hosts come from when tdx makes one itself (a shrink
// re-forms the cross-host part among the survivors). torchdist_ext registers a factory on import
// (torchdist_ext/_backend.py's _gloo_groups, the same code that makes them for a new group), so
// the Gloo device, interface choice (GLOO_SOCKET_IFNAME) and store prefixes are those of torch.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace tdx {

struct GlooGroups {
  c10::intrusive_ptr<c10d::Backend> all;    // every rank of the group
  c10::intrusive_ptr<c10d::Backend> slice;  // the ranks with this rank's local index (uniform layouts), else null
};

// Collective over the ranks of the new group: each calls it with the same store and node ids.
using GlooFactory = std::function<GlooGroups(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                             std::chrono::milliseconds timeout,
                                             const std::vector<std::string>& nodeIds)>;

void setGlooFactory(GlooFactory factory);

// Calls the registered factory; throws when none is registered.
GlooGroups makeGlooGroups(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                          std::chrono::milliseconds timeout, const std::vector<std::string>& nodeIds);

}  // namespace tdx
