#include "multihost/link.h"

#include <c10/util/Exception.h>

#include <chrono>
#include <mutex>
#include <thread>

#include "common/logging.h"
#include "multihost/gloo_wait.h"

namespace tdx {

namespace {
constexpr int64_t kKeepScratchBytes = 256 << 20;
}  // namespace

Link::Link(HostLayout layout, int rank, int size, shm::ShmGroup& local, GlooGroups gloo,
           c10::intrusive_ptr<c10d::Store> store, std::vector<std::string> nodeIds, std::vector<int64_t> globalRanks)
    : layout_(std::move(layout)),
      rank_(rank),
      size_(size),
      local_(local),
      gloo_(std::move(gloo)),
      failures_(std::move(store), rank, std::move(nodeIds), std::move(globalRanks), local.abortFlag()) {
  TORCH_CHECK(gloo_.all, "tdx: the group spans ", layout_.numHosts, " hosts but no Gloo process group was passed "
              "for the cross-host part; create tdx groups through torch.distributed (import torchdist_ext)");
  if (!layout_.uniform) gloo_.slice.reset();
}

void Link::runLocal(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    std::string what = e.what();
    // A host mate this rank timed out on may be failing in its cross-host part at this moment:
    // its Gloo deadline started when it reached the network, which on a loaded host can be a few
    // seconds after this rank's shared-memory wait began. Give it that long to say why (still
    // within the timeout + 5 s every rank is held to), and quote it.
    if (what.find("timed out") != std::string::npos) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(3);
      std::string cause;
      while (cause.empty() && std::chrono::steady_clock::now() < until) {
        for (int p = 0; p < local_.size() && cause.empty(); ++p) {
          if (p != local_.rank()) cause = local_.peerFailure(p);
        }
        if (cause.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      if (!cause.empty()) what = str(what, " because its host mate failed: ", cause);
    }
    // Tell the other hosts, whose ranks only see their Gloo connections close, what happened here.
    failures_.post(what);
    throw Error(what);
  }
}

void Link::wait(const GlooWork& work, const WaitContext& ctx, const std::function<void()>& check) {
  wait(std::vector<GlooWork>{work}, ctx, check);
}

void Link::wait(const std::vector<GlooWork>& works, const WaitContext& ctx, const std::function<void()>& check) {
  bool checkFailed = false;
  std::function<void()> guarded;
  if (check) {
    guarded = [&] {
      try {
        check();
      } catch (...) {
        checkFailed = true;
        throw;
      }
    };
  }
  try {
    // Each ends early when a host mate failed.
    if (works.size() == 1) {
      waitGlooWatchingHost(works[0], ctx, &local_, {gloo_.all, gloo_.slice}, guarded);
    } else {
      waitGlooP2PWatchingHost(works, ctx, &local_, {gloo_.all, gloo_.slice}, guarded);
    }
  } catch (const std::exception& e) {
    if (checkFailed) throw;  // the check's own error (a mismatch) says what happened
    // Aborted or interrupted here (SHRINK_ABORT, an interrupt naming the silent ranks): the error
    // says so already, and nothing on the other hosts needs explaining.
    if (local_.aborted()) throw;
    fail(e, ctx);
  }
}

void Link::fail(const std::exception& e, const WaitContext& ctx) {
  std::vector<std::string> named;
  const std::string msg = failures_.explain(e, ctx, &named);
  {
    std::lock_guard<std::mutex> lock(failedMu_);
    failedHosts_ = std::move(named);
  }
  local_.markFailed(ctx, msg);
  throw Error(msg);
}

void Link::post(std::vector<GlooWork>& works, const std::function<void()>& post, const WaitContext& ctx) {
  try {
    post();
  } catch (const std::exception& e) {
    keepAbandoned(works);
    fail(e, ctx);
  }
}

std::vector<std::string> Link::failedHosts() const {
  std::lock_guard<std::mutex> lock(failedMu_);
  return failedHosts_;
}

at::Tensor Link::scratch(int slot, int64_t numel, at::ScalarType dtype) {
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  if (bytes > kKeepScratchBytes) return at::empty({numel}, at::TensorOptions().dtype(dtype));
  at::Tensor& kept = scratch_[slot];
  if (!kept.defined() || kept.numel() < bytes) {
    kept = at::Tensor();  // the old buffer goes first
    kept = at::empty({bytes}, at::kByte);
  }
  return kept.narrow(0, 0, bytes).view(dtype);
}

}  // namespace tdx
