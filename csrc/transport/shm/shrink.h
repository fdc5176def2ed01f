// Shrinking a shared-memory group in place: the survivors of `parent` (every rank not excluded)
// form a new, smaller ShmGroup, ranks renumbered in order, without the store. Each survivor
// creates a fresh segment and publishes its name in the mailbox of its header in the parent's
// segment, which every survivor still maps; the parent's step counters, buffers and rings are
// left alone, so operations still in flight there cannot disturb the new group.
#pragma once

#include <memory>
#include <vector>

#include "transport/shm/shm_group.h"

namespace tdx::shm {

// Collective over the survivors of `parent` (each calls it with the same `exclude`, once per
// shrink of this parent). `info` names the new group (its rank and size are filled in here).
// Throws when a survivor dies or does not take part before ctx's deadline, naming it.
std::unique_ptr<ShmGroup> shrinkGroup(ShmGroup& parent, const std::vector<int>& exclude, GroupInfo info,
                                      const WaitContext& ctx);

}  // namespace tdx::shm
