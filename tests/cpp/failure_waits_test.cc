// The waits of the cross-host failure path derive from TDX_FAILURE_DETECTION_S: the values the
// path always had at the default 5 s, linear in the knob above a floor, and a bad knob is refused
// with a sentence naming it.
#include "common/failure_waits.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstdint>
#include <string>
#include <vector>

#include "common/env.h"
#include "common/logging.h"

namespace tdx {
namespace {

// The waits in milliseconds: {note, post, mark}.
std::vector<int64_t> ms(const FailureWaits& w) { return {w.note.count(), w.post.count(), w.mark.count()}; }

TEST(FailureWaits, DefaultKnobKeepsTheFormerWaits) {
  EXPECT_EQ(ms(failureWaitsFor(5.0)), (std::vector<int64_t>{800, 500, 1500}));
}

TEST(FailureWaits, ScaleWithTheKnob) {
  EXPECT_EQ(ms(failureWaitsFor(12.5)), (std::vector<int64_t>{2000, 1250, 3750}));
  EXPECT_EQ(ms(failureWaitsFor(2.0)), (std::vector<int64_t>{320, 200, 600}));
}

TEST(FailureWaits, SmallKnobKeepsTheFloor) {
  const int64_t floor = kMinFailureWait.count();
  EXPECT_EQ(ms(failureWaitsFor(0.2)), (std::vector<int64_t>{floor, floor, floor}));
  EXPECT_EQ(ms(failureWaitsFor(0.5)), (std::vector<int64_t>{floor, floor, 150}));
}

TEST(FailureWaits, RejectsANonPositiveTime) {
  EXPECT_THROW(failureWaitsFor(0.0), Error);
  EXPECT_THROW(failureWaitsFor(-1.0), Error);
}

TEST(FailureWaits, ParsesTheKnob) {
  EXPECT_DOUBLE_EQ(parseSeconds("TDX_FAILURE_DETECTION_S", "5"), 5.0);
  EXPECT_DOUBLE_EQ(parseSeconds("TDX_FAILURE_DETECTION_S", "0.75"), 0.75);
  for (const char* bad : {"", "abc", "5s", "0", "-3", "inf", "nan"}) {
    try {
      parseSeconds("TDX_FAILURE_DETECTION_S", bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("TDX_FAILURE_DETECTION_S='"), std::string::npos) << e.what();
    }
  }
}

// The knob as the process reads it, once (ctest runs each test in its own process; nothing else in
// this binary reads the knobs before).
TEST(FailureWaits, ReadsTheEnvironmentOnce) {
  ::setenv("TDX_FAILURE_DETECTION_S", "10", 1);
  EXPECT_DOUBLE_EQ(env().failureDetectionS, 10.0);
  EXPECT_EQ(ms(failureWaits()), (std::vector<int64_t>{1600, 1000, 3000}));
  ::setenv("TDX_FAILURE_DETECTION_S", "1", 1);
  EXPECT_EQ(ms(failureWaits()), (std::vector<int64_t>{1600, 1000, 3000}));  // read once
  ::unsetenv("TDX_FAILURE_DETECTION_S");
}

}  // namespace
}  // namespace tdx
