// Explaining failures of the cross-host part (see cross_host_failure.h).
#include "backend/cross_host_failure.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <future>
#include <memory>
#include <mutex>
#include <thread>

#include "common/logging.h"

namespace tdx {

namespace {

std::string noteKey(int rank) { return str("tdx/hier/failure/", rank); }

// Runs `fn` on its own thread and waits for it at most `limit`. A call that does not finish in
// time (a store on an unreachable host) is left to end on its own; `fn` must own what it uses.
template <class F>
bool finishesWithin(std::chrono::milliseconds limit, F fn) {
  auto done = std::make_shared<std::promise<void>>();
  auto finished = done->get_future();
  std::thread([fn = std::move(fn), done]() mutable {
    try {
      fn();
    } catch (...) {
    }
    done->set_value();
  }).detach();
  return finished.wait_for(limit) == std::future_status::ready;
}

bool contains(const std::string& text, const char* word) {
  std::string lower = text;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  return lower.find(word) != std::string::npos;
}

std::string goneKey(int rank) { return str("tdx/gone/", rank); }

}  // namespace

void postGone(const c10::intrusive_ptr<c10d::Store>& store, int rank, const std::string& why,
              std::chrono::milliseconds wait) {
  if (!store) return;
  finishesWithin(wait, [store, key = goneKey(rank), why] {
    store->set(key, std::vector<uint8_t>(why.begin(), why.end()));
  });
}

std::vector<std::pair<int64_t, std::string>> readGone(const c10::intrusive_ptr<c10d::Store>& store, int size,
                                                      std::chrono::milliseconds wait) {
  if (!store) return {};
  struct Found {
    std::mutex mu;
    std::vector<std::pair<int64_t, std::string>> gone;
  };
  auto found = std::make_shared<Found>();
  const auto until = std::chrono::steady_clock::now() + wait;
  // The store may be unreachable (its host died): look for at most `wait` (a first look always).
  finishesWithin(std::max(wait, CrossHostFailures::kPostWait), [store, found, size, until] {
    for (;;) {
      std::vector<std::pair<int64_t, std::string>> gone;
      for (int r = 0; r < size; ++r) {
        if (store->check({goneKey(r)})) {
          auto v = store->get(goneKey(r));
          gone.emplace_back(r, std::string(v.begin(), v.end()));
        }
      }
      if (!gone.empty()) {
        std::lock_guard<std::mutex> lock(found->mu);
        found->gone = std::move(gone);
        return;
      }
      if (std::chrono::steady_clock::now() >= until) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  std::lock_guard<std::mutex> lock(found->mu);
  return found->gone;
}

std::string firstLine(const std::exception& e) {
  const auto* c10err = dynamic_cast<const c10::Error*>(&e);
  std::string text = c10err ? c10err->what_without_backtrace() : e.what();
  text = text.substr(0, text.find('\n'));
  // Gloo prefixes its messages with "[source.cc:123] ".
  if (!text.empty() && text[0] == '[') {
    const auto close = text.find("] ");
    if (close != std::string::npos) text = text.substr(close + 2);
  }
  // Its first sentence: Gloo follows some with advice of its own ("... Check the logs ... GLHF!").
  const auto stop = text.find(". ");
  return stop == std::string::npos ? text : text.substr(0, stop);
}

CrossHostFailures::CrossHostFailures(c10::intrusive_ptr<c10d::Store> store, int rank, std::vector<std::string> nodeIds,
                                     std::vector<int64_t> globalRanks)
    : store_(std::move(store)), rank_(rank), nodeIds_(std::move(nodeIds)), globalRanks_(std::move(globalRanks)) {}

void CrossHostFailures::post(const std::string& what) const {
  if (!store_) return;
  std::string oneLine = what;
  std::replace(oneLine.begin(), oneLine.end(), '\n', ' ');
  const std::string note = str("rank ", rank_, " on '", nodeIds_[rank_], "' reported: ", oneLine);
  finishesWithin(kPostWait, [store = store_, key = noteKey(rank_), note] {
    store->set(key, std::vector<uint8_t>(note.begin(), note.end()));
  });
}

std::vector<std::string> CrossHostFailures::notes() const {
  if (!store_) return {};
  struct Found {
    std::mutex mu;
    std::vector<std::string> notes;
  };
  auto found = std::make_shared<Found>();
  const int size = static_cast<int>(nodeIds_.size());
  const auto until = std::chrono::steady_clock::now() + kNoteWait;
  finishesWithin(kNoteWait, [store = store_, found, size, self = rank_, until] {
    while (std::chrono::steady_clock::now() < until) {
      for (int r = 0; r < size; ++r) {
        if (r != self && store->check({noteKey(r)})) {
          auto v = store->get(noteKey(r));
          std::lock_guard<std::mutex> lock(found->mu);
          found->notes.emplace_back(v.begin(), v.end());
        }
      }
      {
        std::lock_guard<std::mutex> lock(found->mu);
        if (!found->notes.empty()) return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  std::lock_guard<std::mutex> lock(found->mu);
  return found->notes;
}

std::string CrossHostFailures::otherHosts() const {
  std::vector<std::string> hosts;
  std::string out;
  const bool global = !globalRanks_.empty();
  for (const auto& id : nodeIds_) {
    if (id == nodeIds_[rank_] || std::find(hosts.begin(), hosts.end(), id) != hosts.end()) continue;
    hosts.push_back(id);
    std::string ranks;
    for (size_t r = 0; r < nodeIds_.size(); ++r) {
      if (nodeIds_[r] == id) ranks += str(ranks.empty() ? "" : ", ", global ? globalRanks_[r] : static_cast<int64_t>(r));
    }
    out += str(out.empty() ? "" : " and ", "host '", id, "' (", global ? "global " : "", "ranks [", ranks, "])");
  }
  return out;
}

std::string CrossHostFailures::explain(const std::exception& e, const WaitContext& ctx) const {
  const std::string gloo = firstLine(e);
  std::string msg = str("tdx: ", ctx.op, " (sequence ", ctx.seq, ") failed in its cross-host part: ");
  if (contains(gloo, "timed out") || contains(gloo, "timeout")) {
    msg += str("no answer from ", otherHosts(), " within ", ctx.timeout.count() / 1000.0,
               " s: the network between the hosts is down, or those ranks stopped or hung");
  } else if (contains(gloo, "closed") || contains(gloo, "reset") || contains(gloo, "refused") ||
             contains(gloo, "broken pipe")) {
    msg += str(otherHosts(), " closed the connection: ranks there exited or were killed, or their host went down");
  } else {
    msg += str("the Gloo transfer to ", otherHosts(), " failed");
  }
  msg += str(" (Gloo: ", gloo, ")");
  const auto others = notes();
  for (const auto& n : others) msg += str("; ", n);
  if (others.empty()) msg += ".";
  return msg;
}

}  // namespace tdx
