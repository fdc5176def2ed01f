// Environment knobs. Every knob has the TDX_ prefix and is read once, here.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tdx {

struct EnvKnobs {
  // TDX_BUFFER_BYTES: bytes of each half of a rank's collective buffer (two halves, double-buffered).
  size_t bufferBytes = 8u << 20;
  // TDX_ONESHOT_BYTES: all_reduce/reduce messages up to this size use the one-shot algorithm.
  size_t oneshotBytes = 64u << 10;
  // TDX_P2P_RING_BYTES: bytes of each per-peer send ring.
  size_t p2pRingBytes = 1u << 20;
  // TDX_SPIN: pause-loop iterations before a wait starts yielding the core.
  int spinIters = 2000;
  // TDX_YIELDS: sched_yield() calls before a wait sleeps on a futex.
  int yieldIters = 200;
  // TDX_DEBUG: 1 adds full collective-descriptor checks and verbose errors.
  bool debug = false;
};

// Reads the knobs from the environment on first call; later calls return the same values.
const EnvKnobs& env();

// Parses a size such as "4096", "64K", "8M" or "1G"; throws tdx::Error naming `name` otherwise.
size_t parseSize(const char* name, const char* text);

}  // namespace tdx
