// Bucket assignment for the DDP reducer (torch-free, unit-tested alone).
//
// Parameters are visited in the given order (the reducer passes reverse registration order at
// first, then the gradient-ready order observed in the first iteration), grouped by key (dtype
// and device), and packed into buckets: the first bucket of each key closes once it holds
// `firstBucketBytes`, later ones at `bucketBytes`, so communication can start early in backward.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace tdx {

struct BucketParam {
  size_t bytes;     // gradient size in bytes
  std::string key;  // parameters with different keys (dtype, device) never share a bucket
};

// Returns buckets as lists of parameter indices, each list in visiting order; buckets are ordered
// by when they close (the order in which they would become ready). Every index in `order` appears
// exactly once; throws tdx::Error on a repeated or out-of-range index.
std::vector<std::vector<size_t>> assignBuckets(const std::vector<BucketParam>& params,
                                               const std::vector<size_t>& order, size_t firstBucketBytes,
                                               size_t bucketBytes);

}  // namespace tdx
