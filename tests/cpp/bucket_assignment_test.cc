#include "reducer/bucket_assignment.h"

#include <gtest/gtest.h>

#include "common/logging.h"

namespace tdx {
namespace {

using Buckets = std::vector<std::vector<size_t>>;

std::vector<size_t> reversed(size_t n) {
  std::vector<size_t> v;
  for (size_t i = n; i-- > 0;) v.push_back(i);
  return v;
}

TEST(BucketAssignment, SmallFirstBucketThenCap) {
  // Ten 400-byte float parameters: first bucket closes at 1000 bytes, later ones at 2000.
  std::vector<BucketParam> p(10, BucketParam{400, "float32/cpu"});
  Buckets b = assignBuckets(p, reversed(10), 1000, 2000);
  EXPECT_EQ(b, (Buckets{{9, 8, 7}, {6, 5, 4, 3, 2}, {1, 0}}));
}

TEST(BucketAssignment, KeysNeverShareABucket) {
  std::vector<BucketParam> p = {{100, "f32"}, {100, "f64"}, {100, "f32"}, {100, "f64"}};
  Buckets b = assignBuckets(p, {3, 2, 1, 0}, 150, 1000);
  // f64 closes first at index 1 (3 + 1 = 200 bytes), f32 at index 0.
  EXPECT_EQ(b, (Buckets{{3, 1}, {2, 0}}));
}

TEST(BucketAssignment, OversizedParameterGetsItsOwnBucket) {
  std::vector<BucketParam> p = {{10, "k"}, {5000, "k"}, {10, "k"}};
  Buckets b = assignBuckets(p, {2, 1, 0}, 100, 100);
  EXPECT_EQ(b, (Buckets{{2, 1}, {0}}));
}

TEST(BucketAssignment, FollowsTheGivenOrder) {
  std::vector<BucketParam> p(4, BucketParam{100, "k"});
  Buckets b = assignBuckets(p, {1, 3, 0, 2}, 200, 200);
  EXPECT_EQ(b, (Buckets{{1, 3}, {0, 2}}));
}

TEST(BucketAssignment, EveryParameterExactlyOnce) {
  std::vector<BucketParam> p;
  for (size_t i = 0; i < 37; ++i) p.push_back(BucketParam{(i % 5 + 1) * 64, i % 3 ? "a" : "b"});
  Buckets b = assignBuckets(p, reversed(37), 256, 1024);
  std::vector<int> count(37, 0);
  for (auto& bucket : b) {
    ASSERT_FALSE(bucket.empty());
    for (size_t i : bucket) count[i]++;
  }
  for (int c : count) EXPECT_EQ(c, 1);
}

TEST(BucketAssignment, RejectsBadOrders) {
  std::vector<BucketParam> p(3, BucketParam{8, "k"});
  EXPECT_THROW(assignBuckets(p, {0, 1}, 8, 8), Error);
  EXPECT_THROW(assignBuckets(p, {0, 1, 1}, 8, 8), Error);
  EXPECT_THROW(assignBuckets(p, {0, 1, 7}, 8, 8), Error);
}

}  // namespace
}  // namespace tdx
