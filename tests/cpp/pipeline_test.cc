// The pipeline's decision (csrc/tuning/pipeline.h) as a table: which linear layers batch their
// weight gradients by default. A change shows here, to be justified by a measurement (docs/bench).
#include "tuning/pipeline.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

namespace tdx::tuning {
namespace {

TEST(PipelinePlan, BatchWeightGradsFromTheWeightsSize) {
  std::string t;
  const std::pair<int64_t, int64_t> shapes[] = {{16, 16},   {256, 256},  {384, 384}, {511, 512},
                                                {512, 512}, {1024, 256}, {4096, 64}, {0, 1 << 20}};
  for (auto [in, out] : shapes) {
    t += std::to_string(in) + "x" + std::to_string(out) + (batchWeightGrads(in, out) ? " batch\n" : " per micro-batch\n");
  }
  EXPECT_EQ(t,
            "16x16 per micro-batch\n256x256 per micro-batch\n384x384 per micro-batch\n511x512 per micro-batch\n"
            "512x512 batch\n1024x256 batch\n4096x64 batch\n0x1048576 per micro-batch\n");
}

}  // namespace
}  // namespace tdx::tuning
