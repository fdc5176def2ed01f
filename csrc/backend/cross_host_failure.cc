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
// A rank's timeout mark: the sequence number of the operation it timed out in.
std::string markKey(int rank) { return str("tdx/hier/timedout/", rank); }

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

CrossHostFailures::Heard CrossHostFailures::timeoutMarks(uint64_t seq) const {
  const int size = static_cast<int>(nodeIds_.size());
  Heard none{{}, std::vector<bool>(size, false)};
  if (!store_) return none;
  const std::string mine = std::to_string(seq);
  finishesWithin(kPostWait, [store = store_, key = markKey(rank_), mine] {
    store->set(key, std::vector<uint8_t>(mine.begin(), mine.end()));
  });
  auto heard = std::make_shared<std::pair<std::mutex, Heard>>();
  heard->second = none;
  const auto until = std::chrono::steady_clock::now() + kMarkWait;
  finishesWithin(kMarkWait, [store = store_, heard, size, self = rank_, seq, until, nodeIds = nodeIds_] {
    std::vector<bool> seen(size, false);
    while (std::chrono::steady_clock::now() < until) {
      std::vector<std::string> notes;
      for (int r = 0; r < size; ++r) {
        if (r == self) continue;
        // A rank may time out one operation later than this one (it had finished this one when the
        // link went down) or one earlier: any of these says its host still reaches the store.
        if (!seen[r] && store->check({markKey(r)})) {
          auto v = store->get(markKey(r));
          const uint64_t theirs = std::stoull(std::string(v.begin(), v.end()));
          seen[r] = theirs + 1 >= seq && theirs <= seq + 1;
        }
        if (store->check({noteKey(r)})) {
          auto v = store->get(noteKey(r));
          notes.emplace_back(v.begin(), v.end());
        }
      }
      bool everyHost = true;  // some rank of every other host left its mark
      for (const auto& h : nodeIds) {
        if (h == nodeIds[self]) continue;
        bool any = false;
        for (int r = 0; r < size; ++r) any = any || (nodeIds[r] == h && seen[r]);
        everyHost = everyHost && any;
      }
      {
        std::lock_guard<std::mutex> lock(heard->first);
        heard->second.marked = seen;
        heard->second.notes = std::move(notes);
      }
      if (everyHost) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  std::lock_guard<std::mutex> lock(heard->first);
  return heard->second;
}

std::string CrossHostFailures::hostsWhere(const std::function<bool(const std::string&)>& include) const {
  std::vector<std::string> hosts;
  std::string out;
  const bool global = !globalRanks_.empty();
  for (const auto& id : nodeIds_) {
    if (id == nodeIds_[rank_] || std::find(hosts.begin(), hosts.end(), id) != hosts.end() || !include(id)) continue;
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
  auto every = [](const std::string&) { return true; };
  std::string msg = str("tdx: ", ctx.op, " (sequence ", ctx.seq, ") failed in its cross-host part: ");
  std::vector<std::string> others;
  if (contains(gloo, "timed out") || contains(gloo, "timeout")) {
    // The hosts whose ranks timed out on this operation too reached the store, so their network is
    // up: the ones named are the others. Where none answered (this host cannot reach the store, or
    // every other host is cut off), every other host is named.
    Heard heard = timeoutMarks(ctx.seq);
    others = std::move(heard.notes);
    auto marked = [&](const std::string& host) {
      for (size_t r = 0; r < nodeIds_.size(); ++r) {
        if (nodeIds_[r] == host && heard.marked[r]) return true;
      }
      return false;
    };
    const std::string silent = hostsWhere([&](const std::string& h) { return !marked(h); });
    const std::string reported = hostsWhere(marked);
    msg += str("no answer from ", silent.empty() ? hostsWhere(every) : silent, " within ", ctx.timeout.count() / 1000.0,
               " s: the network between the hosts is down, or those ranks stopped or hung");
    if (silent.empty()) {
      msg += " (every other host's ranks timed out on it too)";
    } else if (!reported.empty()) {
      msg += str(" (", reported, " timed out on it too, so only ",
                 silent.find(" and host ") == std::string::npos ? "that host" : "those hosts", " may be cut off)");
    }
  } else if (contains(gloo, "closed") || contains(gloo, "reset") || contains(gloo, "refused") ||
             contains(gloo, "broken pipe")) {
    msg += str(hostsWhere(every), " closed the connection: ranks there exited or were killed, or their host went down");
    others = notes();
  } else {
    msg += str("the Gloo transfer to ", hostsWhere(every), " failed");
    others = notes();
  }
  msg += str(" (Gloo: ", gloo, ")");
  for (const auto& n : others) msg += str("; ", n);
  if (others.empty()) msg += ".";
  return msg;
}

}  // namespace tdx
