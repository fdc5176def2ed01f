#include "backend/gloo_wait.h"

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>

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

// Process groups with an abandoned operation in flight: never destroyed (see gloo_wait.h).
void keepForever(const std::vector<c10::intrusive_ptr<c10d::Backend>>& groups) {
  static std::mutex mu;
  static auto* kept = new std::vector<c10::intrusive_ptr<c10d::Backend>>();
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& g : groups) {
    if (g) kept->push_back(g);
  }
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
  if (!future) {  // Gloo's p2p Works have none, and a bounded wait on them gives their buffer up
    work->wait(ctx.timeout);
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
    if (local->aborted()) {  // SHRINK_ABORT, or the group's abort
      keepForever(groups);
      throw AbortedError(str("tdx: ", ctx.op, " (sequence ", ctx.seq, ") was aborted while it waited for its "
                             "cross-host part"));
    }
    if (check) {
      try {
        check();
      } catch (...) {
        keepForever(groups);
        throw;
      }
    }
    std::string why = hostMateFailure(*local, ctx.seq);
    if (!why.empty()) {
      keepForever(groups);
      throw PeerFailedError(str("its host mate failed first (", why, ")"));
    }
  }
  work->wait(ctx.timeout);  // finished: rethrows its error
}

}  // namespace tdx
