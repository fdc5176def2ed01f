// Spin-then-sleep waiting on a 32-bit word in shared memory.
//
// A waiter spins briefly (cheap when the peer is running on another core), then yields the
// core (cheap when ranks outnumber cores), then sleeps on a futex. A poster only makes a
// syscall when somebody sleeps, so the fast path is plain loads and stores.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>

namespace tdx::shm {

// A futex word and the number of threads sleeping on it; lives in shared memory.
struct alignas(64) Doorbell {
  std::atomic<uint32_t> word{0};
  std::atomic<uint32_t> sleepers{0};
};

// A wait spins for spinTime (a peer on another core answers within microseconds), then polls
// with sched_yield until yieldTime has passed since the wait began (when ranks outnumber cores
// this hands the core to a peer that needs it), then sleeps on the futex. Sleeping is the last
// resort: waking a sleeping process costs tens to hundreds of microseconds on virtual machines.
struct WaitPolicy {
  std::chrono::microseconds spinTime{50};
  std::chrono::microseconds yieldTime{2000};
};

inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

void futexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds maxSleep);
void futexWakeAll(std::atomic<uint32_t>* word);
void yieldCore();

// Wakes every sleeper of `bell` after its word changed (the caller changed it).
inline void wakeSleepers(Doorbell& bell) {
  if (bell.sleepers.load(std::memory_order_seq_cst) != 0) futexWakeAll(&bell.word);
}

// Increments the word and wakes sleepers.
inline uint32_t ring(Doorbell& bell) {
  uint32_t v = bell.word.fetch_add(1, std::memory_order_seq_cst) + 1;
  wakeSleepers(bell);
  return v;
}

enum class WaitResult { kReady, kTimedOut, kAborted, kPeerFailed };

// Never reports a failed peer (for waits that have no peers to watch).
struct NoProbe {
  bool operator()() const { return false; }
};

// Waits until ready() is true. Sleeps on `bell`, whose word must change (followed by
// wakeSleepers) whenever ready() may have become true. Returns kTimedOut at the deadline and
// kAborted as soon as *abortFlag is set (checked at least every `pollEvery`). Once sleeping, it
// calls probe() at most every `probeEvery` and returns kPeerFailed when it says true (a peer died
// or failed), so the spin and yield phases stay free of system calls.
template <typename Ready, typename Probe = NoProbe>
WaitResult waitUntil(Ready&& ready, Doorbell& bell, std::chrono::steady_clock::time_point deadline,
                     const std::atomic<bool>* abortFlag, const WaitPolicy& policy, Probe&& probe = Probe(),
                     std::chrono::milliseconds pollEvery = std::chrono::milliseconds(10),
                     std::chrono::milliseconds probeEvery = std::chrono::milliseconds(5)) {
  if (ready()) return WaitResult::kReady;
  const auto start = std::chrono::steady_clock::now();
  if (policy.spinTime.count() > 0) {
    const auto spinEnd = start + policy.spinTime;
    for (uint32_t i = 1;; ++i) {
      cpuRelax();
      if (ready()) return WaitResult::kReady;
      if ((i & 63) == 0 && std::chrono::steady_clock::now() >= spinEnd) break;
    }
  }
  const auto yieldEnd = std::min(deadline, start + policy.yieldTime);
  for (uint32_t i = 1;; ++i) {
    if (std::chrono::steady_clock::now() >= yieldEnd) break;
    yieldCore();
    if (ready()) return WaitResult::kReady;
    if ((i & 15) == 0 && abortFlag && abortFlag->load(std::memory_order_relaxed)) return WaitResult::kAborted;
  }
  auto nextProbe = std::chrono::steady_clock::time_point::min();
  while (true) {
    if (abortFlag && abortFlag->load(std::memory_order_relaxed)) return WaitResult::kAborted;
    auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return ready() ? WaitResult::kReady : WaitResult::kTimedOut;
    if (now >= nextProbe) {
      // ready() after a positive probe: a peer may have finished its part just before failing.
      if (probe()) return ready() ? WaitResult::kReady : WaitResult::kPeerFailed;
      nextProbe = now + probeEvery;
    }
    auto sleep = std::min<std::chrono::nanoseconds>(deadline - now, pollEvery);
    bell.sleepers.fetch_add(1, std::memory_order_seq_cst);
    uint32_t seen = bell.word.load(std::memory_order_seq_cst);
    if (!ready()) futexWait(&bell.word, seen, sleep);
    bell.sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (ready()) return WaitResult::kReady;
  }
}

}  // namespace tdx::shm
