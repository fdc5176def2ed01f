#include "collectives/stream_copy.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>

#if defined(__x86_64__)
#include <emmintrin.h>
#include <x86intrin.h>
#endif

#include "common/env.h"

namespace tdx {

namespace {
// TDX_SHM_STREAM unset: each call measures which kind of store is quicker (tuning/plan.cc, "Which
// stores", says why, and holds the rules: tuning::storesSwitch, tuning::storesCost).
// One call in 2^tuning::kStoreTrialBits is a trial of one kind, the same on every rank of the group
// (from the sequence number): half of them try the kind a rank does not use. Every rank stores the
// same way in a trial, whichever kind each uses otherwise: where the ranks of a group disagree
// (each chooses from its own times), a trial in which every rank flipped its kind would still mix
// the kinds, every rank would time mixed calls for both, and the disagreement could last. On the
// AMD VM 1 MB all_reduce sat at 100 us in one run, between ordinary stores' 70 and streaming's 110.
// The first tuning::kStoreUnmeasuredCalls calls of an op and size class touch the pages of both
// buffer halves for the first time (one call took 50x the next): not measured.
constexpr int kOps = 6;  // PeerOp
constexpr int kClasses = 64;  // log2 of the call's bytes

}  // namespace

// One table per process: the groups of a process, dtypes, reduce and all_reduce (gather and
// all_gather) share an op's entry for a size class.
struct PeerCopy::Costs {
  // [ordinary, streaming]: TSC ticks per KiB of the call, smoothed; 0 until measured.
  std::atomic<uint64_t> perKiB[2] = {0, 0};
  std::atomic<bool> streaming{false};  // the kind in use
  std::atomic<uint32_t> calls{0};      // calls that copied, counted up to tuning::kStoreUnmeasuredCalls
};

namespace {
PeerCopy::Costs costs[kOps][kClasses];

int forcedKind() {
  // Read at the first call, not at load time, so a bad TDX_SHM_STREAM raises from that collective
  // (a clear error in Python) instead of aborting the import.
  static const int knob = shmStreamStores();
  return knob;
}

uint64_t ticks() {
#if defined(__x86_64__)
  return __rdtsc();
#else
  return static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
#endif
}

int sizeClass(size_t bytes) { return bytes == 0 ? 0 : 63 - __builtin_clzll(bytes); }

// The same for every rank of the group (from its sequence number), about one call in
// 2^tuning::kStoreTrialBits, and not in step with a repeating pattern of calls.
uint64_t callHash(uint64_t seq) { return (seq + 1) * 0x9E3779B97F4A7C15ull; }
bool exploreCall(uint64_t seq) { return callHash(seq) >> (64 - tuning::kStoreTrialBits) == 0; }
// The kind a trial call uses: the hash's next bit.
bool trialStreams(uint64_t seq) { return (callHash(seq) >> (63 - tuning::kStoreTrialBits)) & 1; }
}  // namespace

PeerCopy::PeerCopy(PeerOp op, size_t bytes, uint64_t seq) {
  const tuning::Stores stores = tuning::storesFor(bytes, forcedKind());  // forced, or too small to measure
  if (stores != tuning::Stores::kMeasured) {
    streaming_ = stores == tuning::Stores::kStreaming;
    return;
  }
  costs_ = &costs[static_cast<int>(op)][sizeClass(bytes)];
  Costs& c = *costs_;
  if (c.calls.load(std::memory_order_relaxed) < tuning::kStoreUnmeasuredCalls) {
    warming_ = true;  // ordinary stores, counted in the destructor if the call copied
    return;
  }
  const uint64_t ordinary = c.perKiB[0].load(std::memory_order_relaxed);
  const uint64_t stream = c.perKiB[1].load(std::memory_order_relaxed);
  // Each kind measured once first (ordinary, then streaming), then the cheaper one (tuning::storesSwitch).
  if (ordinary != 0 && stream != 0) {
    const bool now = c.streaming.load(std::memory_order_relaxed);
    const uint64_t mine = now ? stream : ordinary, other = now ? ordinary : stream;
    if (tuning::storesSwitch(mine, other)) c.streaming.store(!now, std::memory_order_relaxed);
    streaming_ = c.streaming.load(std::memory_order_relaxed);
  } else {
    streaming_ = ordinary != 0;
  }
  explore_ = ordinary != 0 && stream != 0 && exploreCall(seq);
  if (explore_) streaming_ = trialStreams(seq);
  bytes_ = bytes;
  uncaught_ = std::uncaught_exceptions();
  start_ = ticks();
}

PeerCopy::~PeerCopy() {
  if (costs_ == nullptr || !copied_ || std::uncaught_exceptions() > uncaught_) return;
  Costs& c = *costs_;
  if (warming_) {
    c.calls.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  // The time of the whole call: a rank that waited for a late peer counts that too, for either kind
  // alike (the timings compare kinds on average). A clock that went back (a VM's TSC moved between
  // cores) gives no sample.
  const uint64_t end = ticks();
  if (end <= start_) return;
  const uint64_t perKiB = std::max<uint64_t>(1, (end - start_) * 1024 / bytes_);
  std::atomic<uint64_t>& cost = c.perKiB[streaming_ ? 1 : 0];
  cost.store(tuning::storesCost(cost.load(std::memory_order_relaxed), perKiB, explore_), std::memory_order_relaxed);
}

void PeerCopy::operator()(char* dst, const char* src, size_t n) const {
  if (n >= tuning::kStreamMinBytes) copied_ = true;
  if (streaming_) {
    streamCopy(dst, src, n);
  } else {
    std::memcpy(dst, src, n);
  }
}

void streamCopy(char* dst, const char* src, size_t n) {
#if defined(__x86_64__)
  if (n >= tuning::kStreamMinBytes) {
    const size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
    std::memcpy(dst, src, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    std::memcpy(dst + i, src + i, n - i);
    _mm_sfence();
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

}  // namespace tdx
