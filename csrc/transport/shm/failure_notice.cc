#include "transport/shm/failure_notice.h"

#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <cstring>
#include <limits>

#include "transport/shm/shm_group.h"

namespace tdx::shm {

namespace {

constexpr int kSlots = 256;
std::atomic<RankHeader*> gHeaders[kSlots];
// The process that registered each header: a child forked from a rank (a DataLoader worker) maps
// the same segments and inherits this table, yet its failure is not the rank's.
std::atomic<pid_t> gOwners[kSlots];
std::atomic<int64_t> gProgressNs{0};  // the process's last progress in any group

struct FatalSignal {
  int sig;
  const char* reason;
};
constexpr FatalSignal kFatal[] = {
    {SIGTERM, "killed by signal SIGTERM"}, {SIGHUP, "killed by signal SIGHUP"},
    {SIGQUIT, "killed by signal SIGQUIT"}, {SIGABRT, "killed by signal SIGABRT (abort)"},
    {SIGSEGV, "killed by signal SIGSEGV (segmentation fault)"}, {SIGBUS, "killed by signal SIGBUS"},
    {SIGFPE, "killed by signal SIGFPE"},   {SIGILL, "killed by signal SIGILL"},
};

void onFatalSignal(int sig) {
  for (const auto& f : kFatal) {
    if (f.sig == sig) noteProcessFailure(f.reason);
  }
  // SA_RESETHAND restored the default action: re-raise so the process dies of the signal (a
  // synchronous fault re-faults on return), with the exit status its parent expects.
  raise(sig);
}

}  // namespace

void registerOwnHeader(RankHeader* header) {
  for (int i = 0; i < kSlots; ++i) {
    RankHeader* expected = nullptr;
    if (gHeaders[i].compare_exchange_strong(expected, header)) {
      gOwners[i].store(getpid(), std::memory_order_release);
      return;
    }
  }
  // More than kSlots live groups: this one is not announced early (peers still see the exit).
}

void unregisterOwnHeader(RankHeader* header) {
  for (auto& slot : gHeaders) {
    RankHeader* expected = header;
    if (slot.compare_exchange_strong(expected, nullptr)) return;
  }
}

int noteProcessFailure(const char* reason) {
  int marked = 0;
  const pid_t me = getpid();
  for (int i = 0; i < kSlots; ++i) {
    RankHeader* h = gHeaders[i].load(std::memory_order_acquire);
    if (h == nullptr || gOwners[i].load(std::memory_order_acquire) != me) continue;
    FailureNote& f = h->failure;
    if ((f.failed.load(std::memory_order_acquire) & ~kGroupAborted) == 0) {
      const size_t n = std::min(std::strlen(reason), sizeof(f.reason) - 1);
      std::memcpy(f.reason, reason, n);
      f.reason[n] = '\0';
    }
    // Lock-free, so safe in a signal handler; keeps the abort flag (kGroupAborted).
    uint32_t was = f.failed.load(std::memory_order_acquire);
    while (!f.failed.compare_exchange_weak(was, kProcessFailing | (was & kGroupAborted), std::memory_order_acq_rel)) {
    }
    futexWakeAll(&h->step.word);
    futexWakeAll(&h->bell.word);
    ++marked;
  }
  return marked;
}

int64_t monotonicNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

void noteProcessProgress(int64_t nowNs) { gProgressNs.store(nowNs, std::memory_order_relaxed); }

int noteProgressEverywhere() {
  const int64_t now = monotonicNs();
  const pid_t me = getpid();
  int marked = 0;
  for (int i = 0; i < kSlots; ++i) {
    RankHeader* h = gHeaders[i].load(std::memory_order_acquire);
    if (h == nullptr || gOwners[i].load(std::memory_order_acquire) != me) continue;
    h->progressNs.store(now, std::memory_order_relaxed);
    ++marked;
  }
  noteProcessProgress(now);
  return marked;
}

double secondsSinceProgress() {
  const int64_t last = gProgressNs.load(std::memory_order_relaxed);
  if (last == 0) return std::numeric_limits<double>::infinity();
  return static_cast<double>(monotonicNs() - last) / 1e9;
}

int installFatalSignalHandlers() {
  static std::atomic<bool> done{false};
  if (done.exchange(true)) return 0;
  int installed = 0;
  for (const auto& f : kFatal) {
    struct sigaction old;
    if (sigaction(f.sig, nullptr, &old) != 0 || (old.sa_flags & SA_SIGINFO) || old.sa_handler != SIG_DFL) continue;
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_handler = onFatalSignal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESETHAND;
    if (sigaction(f.sig, &sa, nullptr) == 0) ++installed;
  }
  return installed;
}

}  // namespace tdx::shm
