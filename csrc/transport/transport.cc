#include "transport/transport.h"

#include <sstream>

namespace tdx {

std::string GroupInfo::describeRank(int r) const {
  std::ostringstream os;
  os << r;
  if (!globalRanks.empty() && r >= 0 && r < static_cast<int>(globalRanks.size()) && globalRanks[r] != r) {
    os << " (global rank " << globalRanks[r] << ")";
  }
  return os.str();
}

std::string GroupInfo::describeRanks(const std::vector<int>& ranks) const {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < ranks.size(); ++i) {
    os << (i ? ", " : "") << describeRank(ranks[i]);
  }
  os << "]";
  return os.str();
}

}  // namespace tdx
