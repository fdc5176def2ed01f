// Copies into shared memory that a peer reads next, with non-temporal (streaming) stores.
//
// A store to a cache line another core holds (a peer read it in the previous use of the buffer)
// must first invalidate that core's copy; ordinary stores (and glibc's `rep movsb`) wait for each
// of those invalidations, which on some placements of two virtual CPUs costs about 28 ns per line
// (256 KiB: 116 us instead of 5 us). Streaming stores write whole lines without that wait (9 us
// for the same 256 KiB); the peer then reads the lines from memory. See docs/performance.md
// ("The >= 1 MB slow mode").
#pragma once

#include <cstddef>
#include <cstring>

namespace tdx {

// Below this many bytes streamCopy is a plain memcpy: a copy that small stays in the caches, where
// the peer reads it sooner than from memory.
inline constexpr size_t kStreamMinBytes = 16u << 10;

// memcpy(dst, src, n) with streaming stores for the 16-byte aligned bulk of dst (x86-64; plain
// memcpy elsewhere), followed by a store fence so the data is visible before a later release store.
void streamCopy(char* dst, const char* src, size_t n);

// Whether the collectives copy into shared memory with streamCopy: TDX_SHM_STREAM (common/env.h),
// or where it is unset, on AMD CPUs only (stream_copy.cc says why).
bool useStreamCopy();

// A copy into shared memory that peers read next: streamCopy where useStreamCopy(), else memcpy.
inline void copyToPeers(char* dst, const char* src, size_t n) {
  if (useStreamCopy()) {
    streamCopy(dst, src, n);
  } else {
    std::memcpy(dst, src, n);
  }
}

}  // namespace tdx
