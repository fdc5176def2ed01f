#include "collectives/stream_copy.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "common/env.h"

namespace tdx {

namespace {
// TDX_SHM_STREAM unset: streaming stores on AMD CPUs, ordinary stores elsewhere. AMD's last-level
// cache is split between core complexes, and a VM's vCPUs may sit on different ones without the
// guest seeing it: there a store to a line the peer read waited 28 ns per line, and streaming
// stores were 6-7x faster from 256 KB up (2-core AMD EPYC VM, docs/performance.md). Where the
// cores share one last-level cache (the Intel Xeon VMs measured: 2 and 16 cores), the peer reads
// an ordinary copy from that cache, and streaming stores were the slower ones (all_reduce 256 KB-
// 16 MB at 4 and 8 ranks, docs/bench/cpu-16core-stream-ab.txt; scripts/probe_shared_stores.c:
// 12.5 us ordinary vs 22 us streaming for 256 KiB over lines the other vCPU read).
bool chooseStream() {
  const int knob = shmStreamStores();
  return knob >= 0 ? knob == 1 : cpuIsAmd();
}
}  // namespace

bool useStreamCopy() {
  // Chosen at the first copy, not at load time, so a bad TDX_SHM_STREAM raises from that
  // collective (a clear error in Python) instead of aborting the import.
  static const bool stream = chooseStream();
  return stream;
}

void streamCopy(char* dst, const char* src, size_t n) {
#if defined(__x86_64__)
  if (n >= kStreamMinBytes) {
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
