#include "multihost/gloo_wait.h"

#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

#include "common/logging.h"

namespace tdx {

namespace {

constexpr auto kWatchEvery = std::chrono::milliseconds(20);

// What a host mate reports: its failure, or its death ("" when neither). A host mate whose process
// exited or announced its failure after it finished operation `seq` is not counted: it owes this
// operation nothing more (a job's ranks leave as they finish their last collective; counting them
// failed the host mates still waiting for that collective's last bytes from other hosts). A live
// host mate's collective failure always counts, whatever operation it failed in.
std::string hostMateFailure(const shm::ShmGroup& local, uint64_t seq) {
  for (int p = 0; p < local.size(); ++p) {
    if (p == local.rank()) continue;
    std::string why = local.processGone(p);
    if (why.empty()) {
      why = local.peerFailure(p);
    } else if (local.peerFinished(p, seq)) {
      continue;
    }
    if (!why.empty()) return str("rank ", local.info().describeRank(p), " on this host: ", why);
  }
  return "";
}

// Process groups (and p2p Works, which hold their buffers) with an abandoned operation in flight:
// never destroyed (see gloo_wait.h).
void keepForever(const std::vector<c10::intrusive_ptr<c10d::Backend>>& groups,
                 const std::vector<c10::intrusive_ptr<c10d::Work>>& works = {}) {
  static std::mutex mu;
  static auto* kept = new std::vector<c10::intrusive_ptr<c10d::Backend>>();
  static auto* keptWorks = new std::vector<c10::intrusive_ptr<c10d::Work>>();
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& g : groups) {
    if (g) kept->push_back(g);
  }
  keptWorks->insert(keptWorks->end(), works.begin(), works.end());
}

// What one watch period finds wrong for an operation of `local`'s rank: aborted, `check` failed, or
// a host mate failed or died. Throws it; returns when all is well.
void watchOnce(const WaitContext& ctx, const shm::ShmGroup& local, const std::function<void()>& check,
               bool hostMates = true) {
  if (local.aborted()) {  // SHRINK_ABORT, the group's abort, or an interrupt (with its reason)
    const std::string reason = local.abortReason();
    if (!reason.empty()) {
      throw AbortedError(str("tdx: ", ctx.op, " (sequence ", ctx.seq, ") was interrupted while it waited for its "
                             "cross-host part: ", reason));
    }
    throw AbortedError(str("tdx: ", ctx.op, " (sequence ", ctx.seq, ") was aborted while it waited for its "
                           "cross-host part"));
  }
  local.checkNotExcluded(ctx);  // a stuck rank that runs again
  local.noteProgress();          // waiting on other hosts is progress
  if (check) check();
  if (!hostMates) return;
  std::string why = hostMateFailure(local, ctx.seq);
  if (!why.empty()) throw PeerFailedError(str("its host mate failed first (", why, ")"));
}

// Gloo's p2p Works have no future: their waits block in Gloo until done or Gloo's timeout. While a
// thread blocks in them, this process's p2p watcher (one thread, started on first use) runs the
// watch period's checks for it and, when one fails, records the error and aborts the Works, which
// ends their waits.
struct P2PWatch {
  std::mutex mu;  // held while the watcher checks (`check` refers to the waiter's stack)
  bool done = false;
  std::exception_ptr err;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  const WaitContext* ctx = nullptr;
  const shm::ShmGroup* local = nullptr;
  const std::function<void()>* check = nullptr;
  bool hostMates = true;
};

class P2PWatcher {
 public:
  // This process's watcher (a fork's child gets its own: the parent's thread is not in it).
  static P2PWatcher& get() {
    static std::mutex mu;
    static P2PWatcher* watcher = nullptr;  // never destroyed: its thread is detached
    static pid_t pid = 0;
    std::lock_guard<std::mutex> lock(mu);
    if (watcher == nullptr || pid != getpid()) {
      watcher = new P2PWatcher();
      pid = getpid();
    }
    return *watcher;
  }

  void add(const std::shared_ptr<P2PWatch>& w) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!started_) {
      std::thread([this] { loop(); }).detach();
      started_ = true;
    }
    watches_.push_back(w);
    if (asleep_) cv_.notify_one();  // else it looks within one watch period, without a wake-up per wait
  }

  void remove(const std::shared_ptr<P2PWatch>& w) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = watches_.begin(); it != watches_.end(); ++it) {
      if (*it == w) {
        watches_.erase(it);
        return;
      }
    }
  }

 private:
  // Checks every watch period while there are waits; after kIdlePeriods periods without any it
  // sleeps until the next one is added.
  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    int idle = 0;
    while (true) {
      if (watches_.empty() && idle >= kIdlePeriods) {
        asleep_ = true;
        cv_.wait(lock, [&] { return !watches_.empty(); });
        asleep_ = false;
        idle = 0;
      }
      cv_.wait_for(lock, kWatchEvery);
      idle = watches_.empty() ? idle + 1 : 0;
      auto watches = watches_;
      lock.unlock();
      for (const auto& w : watches) checkOne(*w);
      lock.lock();
    }
  }

  static void checkOne(P2PWatch& w) {
    std::lock_guard<std::mutex> lock(w.mu);
    if (w.done || w.err) return;
    try {
      watchOnce(*w.ctx, *w.local, *w.check, w.hostMates);
      return;
    } catch (...) {
      w.err = std::current_exception();
    }
    for (const auto& work : w.works) {
      try {
        work->abort();  // its wait() returns false
      } catch (...) {
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<P2PWatch>> watches_;
  bool started_ = false;
  bool asleep_ = false;
  static constexpr int kIdlePeriods = 50;  // one second
};

// The time left to ctx's deadline for one more wait (kNoTimeout when the context has none).
std::chrono::milliseconds leftOf(const WaitContext& ctx) {
  if (ctx.timeout.count() <= 0) return std::chrono::milliseconds(0);  // Work::wait's kNoTimeout
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(ctx.deadline - std::chrono::steady_clock::now());
  return std::max(left, std::chrono::milliseconds(1));
}

}  // namespace

void waitGlooWatchingHost(const c10::intrusive_ptr<c10d::Work>& work, const WaitContext& ctx,
                          const shm::ShmGroup* local, const std::vector<c10::intrusive_ptr<c10d::Backend>>& groups,
                          const std::function<void()>& check) {
  if (local == nullptr || work->isCompleted()) {
    work->wait(ctx.timeout);  // 0 (kNoTimeout) leaves it to Gloo's own timeout
    return;
  }
  c10::intrusive_ptr<c10::ivalue::Future> future;
  try {
    future = work->getFuture();
  } catch (const std::exception&) {
  }
  if (!future) {  // Gloo's p2p Works have none
    waitGlooP2PWatchingHost({work}, ctx, local, groups, check);
    return;
  }
  struct Done {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
  };
  auto done = std::make_shared<Done>();
  future->addCallback([done](c10::ivalue::Future&) {
    {
      std::lock_guard<std::mutex> lock(done->mu);
      done->done = true;
    }
    done->cv.notify_all();
  });
  // One watch period: true once the operation finished (successfully or not).
  auto finished = [&] {
    std::unique_lock<std::mutex> lock(done->mu);
    return done->cv.wait_for(lock, kWatchEvery, [&] { return done->done; });
  };
  while (!finished()) {
    if (ctx.timeout.count() > 0 && std::chrono::steady_clock::now() >= ctx.deadline) {
      work->wait(std::chrono::milliseconds(1));  // throws Gloo's "timed out" unless it just finished
      return;
    }
    try {
      watchOnce(ctx, *local, check);
    } catch (...) {
      keepForever(groups);
      throw;
    }
  }
  work->wait(ctx.timeout);  // finished: rethrows its error
}

void keepAbandoned(std::vector<c10::intrusive_ptr<c10d::Work>>& works) {
  std::vector<c10::intrusive_ptr<c10d::Work>> open;
  for (auto& w : works) {
    if (w && !w->isCompleted()) open.push_back(std::move(w));
  }
  keepForever({}, open);
  works.clear();
}

void waitGlooP2PWatchingHost(const std::vector<c10::intrusive_ptr<c10d::Work>>& works, const WaitContext& ctx,
                             const shm::ShmGroup* local,
                             const std::vector<c10::intrusive_ptr<c10d::Backend>>& groups,
                             const std::function<void()>& check, bool hostMates) {
  if (local == nullptr) {
    for (const auto& w : works) w->wait(leftOf(ctx));  // kNoTimeout leaves it to Gloo's own timeout
    return;
  }
  // A bounded wait on a Gloo p2p Work that times out fails its whole Gloo context, so each wait
  // runs to ctx's deadline and the watcher ends it sooner when the host says so.
  auto watch = std::make_shared<P2PWatch>();
  watch->works = works;
  watch->ctx = &ctx;
  watch->local = local;
  watch->check = &check;
  watch->hostMates = hostMates;
  P2PWatcher& watcher = P2PWatcher::get();
  watcher.add(watch);
  std::exception_ptr waitErr;
  try {
    for (const auto& w : works) w->wait(leftOf(ctx));
  } catch (...) {
    waitErr = std::current_exception();
  }
  std::exception_ptr watchErr;
  {
    std::lock_guard<std::mutex> lock(watch->mu);
    watch->done = true;
    watchErr = watch->err;
  }
  watcher.remove(watch);
  if (watchErr || waitErr) keepForever(groups, works);  // a receive given up on may still be written
  if (watchErr) std::rethrow_exception(watchErr);
  if (waitErr) std::rethrow_exception(waitErr);
}

}  // namespace tdx
