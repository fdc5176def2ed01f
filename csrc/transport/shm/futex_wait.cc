#include "transport/shm/futex_wait.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <climits>

namespace tdx::shm {

void futexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds maxSleep) {
  struct timespec ts;
  ts.tv_sec = static_cast<time_t>(maxSleep.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(maxSleep.count() % 1000000000);
  // Not FUTEX_PRIVATE: the word is shared between processes.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void yieldCore() { sched_yield(); }

}  // namespace tdx::shm
