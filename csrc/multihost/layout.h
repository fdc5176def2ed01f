// Where each rank of a group sits among its hosts.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace tdx {

struct HostLayout {
  int numHosts = 1;
  int hostIndex = 0;             // hosts are numbered in the order of their lowest group rank
  int localRank = 0;
  int localSize = 1;
  std::vector<int> localRanks;   // group ranks on this host, ascending
  std::vector<std::vector<int>> hostRanks;  // group ranks of each host, by host index
  bool uniform = true;           // every host has localSize ranks

  // (host index, local index) of group rank `rank`.
  std::pair<int, int> placeOf(int rank) const;
};

// Groups ranks by node id (`nodeIds[r]` for group rank r).
HostLayout computeHostLayout(const std::vector<std::string>& nodeIds, int rank);

}  // namespace tdx
