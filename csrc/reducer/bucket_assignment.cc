#include "reducer/bucket_assignment.h"

#include <map>

#include "common/logging.h"

namespace tdx {

std::vector<std::vector<size_t>> assignBuckets(const std::vector<BucketParam>& params,
                                               const std::vector<size_t>& order, size_t firstBucketBytes,
                                               size_t bucketBytes) {
  TDX_ENFORCE(order.size() == params.size(), "bucket order lists ", order.size(), " parameters but there are ",
              params.size());
  struct Open {
    std::vector<size_t> members;
    size_t bytes = 0;
    bool closedOne = false;  // after the first bucket of a key closes, later ones use bucketBytes
  };
  std::map<std::string, Open> open;
  std::vector<std::vector<size_t>> buckets;
  std::vector<bool> seen(params.size(), false);
  for (size_t idx : order) {
    TDX_ENFORCE(idx < params.size(), "bucket order names parameter ", idx, " of ", params.size());
    TDX_ENFORCE(!seen[idx], "bucket order names parameter ", idx, " twice");
    seen[idx] = true;
    Open& b = open[params[idx].key];
    b.members.push_back(idx);
    b.bytes += params[idx].bytes;
    const size_t limit = b.closedOne ? bucketBytes : firstBucketBytes;
    if (b.bytes >= limit) {
      buckets.push_back(std::move(b.members));
      b.members.clear();
      b.bytes = 0;
      b.closedOne = true;
    }
  }
  for (auto& kv : open) {
    if (!kv.second.members.empty()) buckets.push_back(std::move(kv.second.members));
  }
  return buckets;
}

}  // namespace tdx
