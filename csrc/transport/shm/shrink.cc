#include "transport/shm/shrink.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "common/logging.h"

namespace tdx::shm {

namespace {

// The rendezvous of a shrink: keys live in the mailbox of their writer's header in the parent's
// segments, stamped with the shrink's number; get() looks through every survivor's mailbox.
class MailboxRendezvous : public Rendezvous {
 public:
  MailboxRendezvous(ShmGroup& parent, std::vector<int> survivors, uint32_t gen, const WaitContext& ctx)
      : parent_(parent), survivors_(std::move(survivors)), gen_(gen), ctx_(ctx) {
    // Survivors that disagree on who survives must never read each other's keys (their new rank
    // numbers differ): every key carries the survivor set.
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the survivors' parent ranks
    for (int r : survivors_) h = (h ^ static_cast<uint64_t>(r + 1)) * 1099511628211ull;
    prefix_ = str(std::hex, h, "/");
  }

  void set(const std::string& plainKey, const std::string& value) override {
    const std::string key = prefix_ + plainKey;
    auto& slots = parent_.header(parent_.rank()).mailbox;
    TDX_ENFORCE(used_ < static_cast<int>(std::size(slots)), "shrink: more than ", std::size(slots),
                " keys published by one rank");
    auto& s = slots[used_++];
    TDX_ENFORCE(key.size() < sizeof(s.key) && value.size() < sizeof(s.value), "shrink: key '", key,
                "' or its value is too long for the mailbox");
    s.gen.store(0, std::memory_order_release);
    std::memset(s.key, 0, sizeof(s.key));
    std::memset(s.value, 0, sizeof(s.value));
    std::memcpy(s.key, key.data(), key.size());
    std::memcpy(s.value, value.data(), value.size());
    s.gen.store(gen_, std::memory_order_release);
  }

  std::string get(const std::string& plainKey) override {
    const std::string key = prefix_ + plainKey;
    for (auto pause = std::chrono::microseconds(20);; pause = std::min(pause * 2, std::chrono::microseconds(2000))) {
      for (int r : survivors_) {
        for (auto& s : parent_.header(r).mailbox) {
          if (s.gen.load(std::memory_order_acquire) == gen_ && key == s.key) return std::string(s.value);
        }
      }
      std::string gone;
      for (int r : survivors_) {
        const std::string d = parent_.processGone(r);
        if (!d.empty()) gone += (gone.empty() ? "" : "; ") + d;
      }
      if (!gone.empty()) {
        throw PeerFailedError(str("tdx: shrinking group '", parent_.info().name, "' failed on rank ",
                                  parent_.info().describeRank(parent_.rank()), ": a survivor is gone: ", gone,
                                  ". Shrink again, excluding it too"));
      }
      if (std::chrono::steady_clock::now() >= ctx_.deadline) {
        throw TimeoutError(str("tdx: shrinking group '", parent_.info().name, "' timed out after ",
                               ctx_.timeout.count(), " ms on rank ", parent_.info().describeRank(parent_.rank()),
                               " waiting for '", plainKey, "' from survivors ",
                               parent_.info().describeRanks(survivors_), ": every survivor must call shrink with "
                               "the same ranks to exclude"));
      }
      std::this_thread::sleep_for(pause);
    }
  }

 private:
  ShmGroup& parent_;
  std::vector<int> survivors_;
  uint32_t gen_;
  WaitContext ctx_;
  std::string prefix_;
  int used_ = 0;
};

}  // namespace

std::unique_ptr<ShmGroup> shrinkGroup(ShmGroup& parent, const std::vector<int>& exclude, GroupInfo info,
                                      const WaitContext& ctx) {
  std::vector<int> survivors;
  for (int r = 0; r < parent.size(); ++r) {
    if (std::find(exclude.begin(), exclude.end(), r) == exclude.end()) survivors.push_back(r);
  }
  const auto me = std::find(survivors.begin(), survivors.end(), parent.rank());
  TDX_ENFORCE(me != survivors.end(), "shrink: rank ", parent.rank(), " is excluded and cannot take part");
  info.rank = static_cast<int>(me - survivors.begin());
  info.size = static_cast<int>(survivors.size());
  if (!parent.info().globalRanks.empty()) {
    info.globalRanks.clear();
    for (int r : survivors) info.globalRanks.push_back(parent.info().globalRanks[r]);
  }
  // Fence the excluded ranks in the parent first: one that is alive (stuck, or left out) and runs
  // again fails its next operation there, saying it was excluded, instead of waiting on survivors
  // that have left. A fence set earlier (the stuck-rank watch) keeps its reason.
  for (int r : exclude) {
    if (r >= 0 && r < parent.size() && r != parent.rank()) {
      parent.exclude(r, str("rank ", parent.info().describeRank(r), " (pid ", parent.pid(r), ") was excluded from "
                            "the group by its survivors (shrink_group)"));
    }
  }
  MailboxRendezvous rdv(parent, survivors, parent.nextShrink(), ctx);
  auto child = std::make_unique<ShmGroup>(info, rdv, parent.options());
  child->setStuckTimeout(parent.stuckTimeout());
  return child;
}

}  // namespace tdx::shm
