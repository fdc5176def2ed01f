// Waiting for a Gloo operation of a group spanning hosts while watching this host's ranks.
//
// Gloo cannot interrupt an operation: one whose peer on another host left it (that peer's own
// host mate died, so it stopped) waits until Gloo's timeout. Its host mates know sooner: one of
// them failed (a Gloo connection to the dead rank closed) or died. This wait ends as soon as a
// host mate failed or died, so every survivor learns of a failure within milliseconds and can
// shrink the group. The abandoned operation then still runs in Gloo's worker thread until Gloo's
// timeout: its process groups are kept alive for the life of the process (one group's worth of
// threads per abandoned wait; destroying them would block until that timeout). Works without a
// future (Gloo's p2p ones, which run on the calling thread and Gloo's device thread) are waited
// for on the calling thread while one watcher thread per process checks the host for them and
// aborts them (Work::abort) when a check fails.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <functional>
#include <vector>

#include "transport/shm/shm_group.h"
#include "transport/transport.h"

namespace tdx {

// Waits for `work` until ctx's deadline (ctx.timeout 0: Gloo's own timeout) and rethrows its
// error. Throws PeerFailedError naming the host mate when one of `local`'s ranks failed or died
// first, and AbortedError when `local` is aborted (SHRINK_ABORT), keeping `groups` (the process
// groups `work` runs on) alive. `local` may be null. `check`, when given, runs once per watch
// period while the operation is in flight (a check of this host's descriptors, say); what it throws
// ends the wait the same way, keeping `groups`.
void waitGlooWatchingHost(const c10::intrusive_ptr<c10d::Work>& work, const WaitContext& ctx,
                          const shm::ShmGroup* local, const std::vector<c10::intrusive_ptr<c10d::Backend>>& groups,
                          const std::function<void()>& check = nullptr);

// Keeps the Works of `works` not yet completed (and so their tensors) alive for the process's
// life, and clears `works`: Gloo may still write into (or read from) the buffers of a transfer
// given up on.
void keepAbandoned(std::vector<c10::intrusive_ptr<c10d::Work>>& works);

// The same for Gloo p2p Works (no future), waited for in order: one error for all of them. A wait
// that failed keeps `works` (their buffers may still be written) alive with `groups`.
// `hostMates` false: only an abort or interrupt of `local` ends the wait early (a user's p2p, which
// a host mate's failure does not concern).
void waitGlooP2PWatchingHost(const std::vector<c10::intrusive_ptr<c10d::Work>>& works, const WaitContext& ctx,
                             const shm::ShmGroup* local,
                             const std::vector<c10::intrusive_ptr<c10d::Backend>>& groups,
                             const std::function<void()>& check = nullptr, bool hostMates = true);

}  // namespace tdx
