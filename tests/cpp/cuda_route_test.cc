// planCudaRoute: which ranks share a GPU and which path the whole group takes.
#include "tuning/cuda_route.h"

#include <gtest/gtest.h>

#include "common/logging.h"

namespace tdx::test {
namespace {

TEST(DeviceSharing, OwnGpusUseNccl) {
  const auto p = planCudaRoute({"a", "a", "a", "a"}, {"GPU-0", "GPU-1", "GPU-2", "GPU-3"}, "auto");
  EXPECT_EQ(p.route, CudaRoute::kNccl);
  EXPECT_TRUE(p.sharing.empty());
}

TEST(DeviceSharing, SameUuidOnDifferentHostsIsNotSharing) {
  // Identities are per host (PCI bus ids repeat across hosts).
  const auto p = planCudaRoute({"a", "b"}, {"0000:1a:00.0", "0000:1a:00.0"}, "auto");
  EXPECT_EQ(p.route, CudaRoute::kNccl);
}

TEST(DeviceSharing, AllRanksOnOneGpuStage) {
  const auto p = planCudaRoute({"a", "a", "a"}, {"GPU-0", "GPU-0", "GPU-0"}, "auto");
  EXPECT_EQ(p.route, CudaRoute::kStaged);
  ASSERT_EQ(p.sharing.size(), 1u);
  EXPECT_EQ(p.sharing[0], (std::vector<int>{0, 1, 2}));
  EXPECT_NE(p.reason.find("ranks [0, 1, 2] share GPU GPU-0 on host 'a'"), std::string::npos) << p.reason;
}

TEST(DeviceSharing, SomeRanksSharingStagesTheWholeGroup) {
  const auto p = planCudaRoute({"a", "a", "a", "a"}, {"GPU-1", "GPU-0", "GPU-1", "GPU-2"}, "auto");
  EXPECT_EQ(p.route, CudaRoute::kStaged);
  ASSERT_EQ(p.sharing.size(), 1u);
  EXPECT_EQ(p.sharing[0], (std::vector<int>{0, 2}));
  EXPECT_NE(p.reason.find("whole group"), std::string::npos);
}

TEST(DeviceSharing, TwoPairsReportedInRankOrder) {
  const auto p = planCudaRoute({"a", "a", "a", "a"}, {"Z", "A", "Z", "A"}, "auto");
  ASSERT_EQ(p.sharing.size(), 2u);
  EXPECT_EQ(p.sharing[0], (std::vector<int>{0, 2}));
  EXPECT_EQ(p.sharing[1], (std::vector<int>{1, 3}));
}

TEST(DeviceSharing, ForcedPaths) {
  EXPECT_EQ(planCudaRoute({"a", "a"}, {"0", "1"}, "staged").route, CudaRoute::kStaged);
  EXPECT_EQ(planCudaRoute({"a", "a"}, {"0", "1"}, "nccl").route, CudaRoute::kNccl);
  try {
    planCudaRoute({"a", "a"}, {"0", "0"}, "nccl");
    FAIL() << "nccl forced on a shared GPU must throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("Duplicate GPU detected"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("ranks [0, 1] share GPU 0"), std::string::npos) << e.what();
  }
  EXPECT_THROW(planCudaRoute({"a"}, {"0"}, "gloo"), Error);
  EXPECT_THROW(planCudaRoute({"a"}, {"0", "1"}, "auto"), Error);
}

}  // namespace
}  // namespace tdx::test
