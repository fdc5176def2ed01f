// torch.ops.tdx.* (direct_ops.cc): how their group_name "" finds torch.distributed's default group.
#pragma once

#include <functional>
#include <optional>
#include <string>

namespace tdx {

// Registers `name`, which returns the group_name of torch.distributed's current default group
// (nullopt when there is none). The package registers it at import (torchdist_ext/_direct_ops.py);
// the direct ops ask it again only when the group they found last is no longer registered under
// that name (the default group was destroyed, or shrunk: its replacement has another name).
void setDefaultGroupName(std::function<std::optional<std::string>()> name);

}  // namespace tdx
