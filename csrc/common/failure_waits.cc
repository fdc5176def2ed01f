#include "common/failure_waits.h"

#include <algorithm>
#include <cmath>

#include "common/env.h"
#include "common/logging.h"

namespace tdx {

namespace {

std::chrono::milliseconds share(double detectionSeconds, double fraction) {
  const auto ms = std::chrono::milliseconds(std::llround(detectionSeconds * fraction * 1000.0));
  return std::max(ms, kMinFailureWait);
}

}  // namespace

FailureWaits failureWaitsFor(double detectionSeconds) {
  TDX_ENFORCE(detectionSeconds > 0, "the failure-detection time must be > 0 seconds, got ", detectionSeconds);
  return {share(detectionSeconds, 0.16), share(detectionSeconds, 0.1), share(detectionSeconds, 0.3)};
}

const FailureWaits& failureWaits() {
  static const FailureWaits waits = failureWaitsFor(env().failureDetectionS);
  return waits;
}

}  // namespace tdx
