// The waits of the failure path across hosts, derived from the one failure-detection time
// (TDX_FAILURE_DETECTION_S, seconds, default 5; the same knob the elastic trainers' liveness leases
// and stuck-rank watch use). Torch-free, so the derivation is tested alone (failure_waits_test.cc).
#pragma once

#include <chrono>

namespace tdx {

struct FailureWaits {
  // How long a rank whose Gloo connection closed waits for another rank's note saying why
  // (detection x 0.16: 0.8 s at the default 5 s).
  std::chrono::milliseconds note;
  // How long a failing rank waits for its own note (or a gone rank's) to be stored (detection x 0.1:
  // 0.5 s).
  std::chrono::milliseconds post;
  // How long a rank whose Gloo wait timed out looks for the other hosts' timeout marks (detection
  // x 0.3: 1.5 s; less when every host's mark is there).
  std::chrono::milliseconds mark;
};

// Each wait is at least kMinFailureWait: a store round trip on a loaded host, so that a small
// detection time still leaves the notes a chance to arrive.
constexpr std::chrono::milliseconds kMinFailureWait{100};

// The waits for a detection time of `detectionSeconds` (> 0).
FailureWaits failureWaitsFor(double detectionSeconds);

// The waits for TDX_FAILURE_DETECTION_S, read once (env().failureDetectionS).
const FailureWaits& failureWaits();

}  // namespace tdx
