// A process that is about to die tells the peers of every shared-memory group it belongs to, so
// they raise within milliseconds naming it and why, instead of noticing only once it has exited.
// The Python layer calls noteProcessFailure() from sys.excepthook, sys.exit with a non-zero code
// and atexit; installFatalSignalHandlers() covers the catchable fatal signals.
#pragma once

#include <atomic>
#include <cstdint>

namespace tdx::shm {

struct RankHeader;

// FailureNote::failed values: a collective of the rank failed (its process may go on), or the
// rank's process is failing (an uncaught exception, a non-zero exit, a fatal signal).
constexpr uint32_t kCollectiveFailed = 1;
constexpr uint32_t kProcessFailing = 2;
// A flag or'ed into FailureNote::failed: the rank aborted the group (abort(), destroy_process_group,
// shrink_group with SHRINK_ABORT) and will send or receive nothing more on it. Only p2p waits read
// it (ShmGroup::peerAborted); collectives and Gloo waits see the values above, as before.
constexpr uint32_t kGroupAborted = 0x100;

// Every ShmGroup registers its own rank's header while it lives (lock-free, bounded table).
void registerOwnHeader(RankHeader* header);
void unregisterOwnHeader(RankHeader* header);

// Marks this rank failed in every live group of the process with `reason` (kept when a collective
// of that group already failed here: that reason names where the failure came from), and wakes
// the peers sleeping on it. A process forked from a rank (a DataLoader worker) marks nothing.
// Async-signal-safe. Returns the number of groups marked.
int noteProcessFailure(const char* reason);

// For SIGTERM, SIGHUP, SIGQUIT, SIGABRT, SIGSEGV, SIGBUS, SIGFPE and SIGILL whose disposition is
// the default: a handler that calls noteProcessFailure("killed by signal SIGx") and then lets
// the signal take its default action. Idempotent; returns the number of handlers installed.
int installFatalSignalHandlers();

// Progress marks, for telling a stuck rank (alive, making no progress) from a busy one (shm_group.h).
// CLOCK_MONOTONIC in nanoseconds: one clock for every process of the host.
int64_t monotonicNs();
// Records that this process made progress at `nowNs` (every ShmGroup's noteProgress calls it).
void noteProcessProgress(int64_t nowNs);
// Records progress in every live group of the process (an elastic trainer's finished step) and in
// the process's mark. Returns the number of groups marked.
int noteProgressEverywhere();
// Seconds since this process last made progress in any group (infinity before any).
double secondsSinceProgress();

}  // namespace tdx::shm
