#include "multihost/layout.h"

#include <algorithm>
#include <map>

#include "common/logging.h"

namespace tdx {

HostLayout computeHostLayout(const std::vector<std::string>& nodeIds, int rank) {
  HostLayout l;
  std::map<std::string, int> hostOf;
  std::vector<int> counts;
  for (const auto& id : nodeIds) {
    auto it = hostOf.find(id);
    if (it == hostOf.end()) {
      hostOf.emplace(id, static_cast<int>(counts.size()));
      counts.push_back(0);
    }
    ++counts[hostOf[id]];
  }
  l.numHosts = static_cast<int>(counts.size());
  l.hostRanks.resize(counts.size());
  for (int r = 0; r < static_cast<int>(nodeIds.size()); ++r) l.hostRanks[hostOf.at(nodeIds[r])].push_back(r);
  l.hostIndex = hostOf.at(nodeIds.at(rank));
  for (int r = 0; r < static_cast<int>(nodeIds.size()); ++r) {
    if (nodeIds[r] != nodeIds[rank]) continue;
    if (r == rank) l.localRank = static_cast<int>(l.localRanks.size());
    l.localRanks.push_back(r);
  }
  l.localSize = static_cast<int>(l.localRanks.size());
  for (int c : counts) l.uniform = l.uniform && c == l.localSize;
  return l;
}

std::pair<int, int> HostLayout::placeOf(int rank) const {
  for (int h = 0; h < numHosts; ++h) {
    const auto& rs = hostRanks[h];
    const auto it = std::find(rs.begin(), rs.end(), rank);
    if (it != rs.end()) return {h, static_cast<int>(it - rs.begin())};
  }
  throw Error(str("tdx internal error: rank ", rank, " is on no host of the group"));
}

}  // namespace tdx
