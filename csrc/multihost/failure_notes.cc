// Explaining failures of the cross-host part (see failure_notes.h).
#include "multihost/failure_notes.h"

#include <c10/util/Exception.h>
#include <cxxabi.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <future>
#include <memory>
#include <mutex>
#include <thread>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "common/logging.h"

namespace tdx {

namespace {

std::string noteKey(int rank) { return str("tdx/hier/failure/", rank); }
// A rank's failure mark: the sequence number of the operation it failed in, followed by " timeout"
// where Gloo's wait timed out.
std::string markKey(int rank) { return str("tdx/hier/timedout/", rank); }

// Where every host is alive and reaches the store and the hosts waited for each other, a network
// fault is less likely than ranks that called different collectives (roots or sizes that differ
// between hosts, where each host's own check cannot see it).
constexpr const char* kSuggestMismatch =
    "the hosts may also have called different collectives here, e.g. another root or size: TDX_DEBUG=1 "
    "compares every rank's call across hosts and names the difference";

// The store calls of finishesWithin still running (see pendingStoreCalls).
std::atomic<int> running{0};

// Runs `fn` on its own thread and waits for it at most `limit`. A call that does not finish in
// time (a store on an unreachable host) is left to end on its own; `fn` must own what it uses.
template <class F>
bool finishesWithin(std::chrono::milliseconds limit, F fn) {
  auto done = std::make_shared<std::promise<void>>();
  auto finished = done->get_future();
  running.fetch_add(1);
  std::thread([fn = std::move(fn), done]() mutable {
    struct Count {
      ~Count() { running.fetch_sub(1); }
    } count;
    try {
      fn();
    } catch (abi::__forced_unwind&) {
      // The interpreter is exiting and ends this thread as it waits for the GIL (a store written
      // in Python): let it end (swallowing the unwind aborts the process).
      throw;
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

// Not in failure_notes.h: only the Python bindings ask (at exit, a store written in Python must not
// be called once the interpreter is gone).
int pendingStoreCalls() { return running.load(); }

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
  finishesWithin(std::max(wait, failureWaits().post), [store, found, size, until] {
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
                                     std::vector<int64_t> globalRanks, const std::atomic<bool>* interrupted)
    : store_(std::move(store)),
      rank_(rank),
      nodeIds_(std::move(nodeIds)),
      globalRanks_(std::move(globalRanks)),
      interrupted_(interrupted) {}

void CrossHostFailures::post(const std::string& what, std::chrono::milliseconds wait) const {
  if (!store_) return;
  std::string oneLine = what;
  std::replace(oneLine.begin(), oneLine.end(), '\n', ' ');
  const std::string note = str("rank ", rank_, " on '", nodeIds_[rank_], "' reported: ", oneLine);
  finishesWithin(wait, [store = store_, key = noteKey(rank_), note] {
    store->set(key, std::vector<uint8_t>(note.begin(), note.end()));
  });
}

void CrossHostFailures::postMark(uint64_t seq, bool timedOut) const {
  if (!store_) return;
  // Not waited for: the store may be unreachable, and the callers' deadlines are short.
  finishesWithin(std::chrono::milliseconds(0), [store = store_, key = markKey(rank_), seq, timedOut] {
    const std::string v = std::to_string(seq) + (timedOut ? " timeout" : "");
    store->set(key, std::vector<uint8_t>(v.begin(), v.end()));
  });
}

CrossHostFailures::Heard CrossHostFailures::listen(uint64_t seq, std::chrono::milliseconds wait, Until until) const {
  const int size = static_cast<int>(nodeIds_.size());
  Heard none{{}, std::vector<bool>(size, false), std::vector<bool>(size, false)};
  if (!store_) return none;
  auto heard = std::make_shared<std::pair<std::mutex, Heard>>();
  heard->second = none;
  const auto deadline = std::chrono::steady_clock::now() + wait;
  finishesWithin(wait, [store = store_, heard, size, self = rank_, seq, deadline, until, nodeIds = nodeIds_,
                        interrupted = interrupted_] {
    std::vector<bool> seen(size, false), timedOut(size, false);
    for (;;) {
      if (interrupted && interrupted->load()) return;
      std::vector<std::pair<int, std::string>> notes;
      for (int r = 0; r < size; ++r) {
        if (r == self) continue;
        // A rank may fail one operation later than this one (it had finished this one when the
        // link went down) or one earlier: either says its host still reaches the store.
        if (!seen[r] && store->check({markKey(r)})) {
          const auto v = store->get(markKey(r));
          const std::string mark(v.begin(), v.end());
          const uint64_t theirs = std::stoull(mark);
          seen[r] = theirs + 1 >= seq && theirs <= seq + 1;
          timedOut[r] = theirs == seq && mark.find(" timeout") != std::string::npos;
        }
        if (store->check({noteKey(r)})) {
          auto v = store->get(noteKey(r));
          notes.emplace_back(r, std::string(v.begin(), v.end()));
        }
      }
      bool everyHost = true;          // some rank of every other host left its mark
      bool everyHostTimedOut = true;  // some rank of every other host timed out in this operation
      for (const auto& h : nodeIds) {
        if (h == nodeIds[self]) continue;
        bool any = false, anyTimedOut = false;
        for (int r = 0; r < size; ++r) {
          any = any || (nodeIds[r] == h && seen[r]);
          anyTimedOut = anyTimedOut || (nodeIds[r] == h && timedOut[r]);
        }
        everyHost = everyHost && any;
        everyHostTimedOut = everyHostTimedOut && anyTimedOut;
      }
      const bool anyNote = !notes.empty();
      {
        std::lock_guard<std::mutex> lock(heard->first);
        heard->second.marked = seen;
        heard->second.timedOut = timedOut;
        heard->second.notes = std::move(notes);
      }
      if (until == Until::kEveryHostMarked ? everyHost : anyNote || everyHostTimedOut) return;
      if (std::chrono::steady_clock::now() >= deadline) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  std::lock_guard<std::mutex> lock(heard->first);
  return heard->second;
}

std::string CrossHostFailures::hostOfAddress(const std::string& gloo) const {
  // Gloo names the peer of a failed connection as "[address]:port".
  const auto open = gloo.find('[');
  if (open == std::string::npos) return "";
  const auto close = gloo.find("]:", open);
  if (close == std::string::npos) return "";
  const std::string address = gloo.substr(open + 1, close - open - 1);
  const std::vector<std::string> hosts = otherHosts();
  // Node ids are host names unless TDX_NODE_ID says otherwise; names that do not resolve in time
  // (a slow DNS) leave the host unknown.
  auto found = std::make_shared<std::pair<std::mutex, std::string>>();
  finishesWithin(kResolveWait, [found, hosts, address] {
    for (const auto& h : hosts) {
      addrinfo hints{};
      hints.ai_family = AF_UNSPEC;
      hints.ai_socktype = SOCK_STREAM;
      addrinfo* res = nullptr;
      if (getaddrinfo(h.c_str(), nullptr, &hints, &res) != 0) continue;
      bool match = false;
      for (addrinfo* a = res; a != nullptr && !match; a = a->ai_next) {
        char text[INET6_ADDRSTRLEN] = {0};
        const void* raw = a->ai_family == AF_INET6
                              ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr)
                              : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr);
        match = inet_ntop(a->ai_family, raw, text, sizeof(text)) != nullptr && address == text;
      }
      freeaddrinfo(res);
      if (match) {
        std::lock_guard<std::mutex> lock(found->first);
        found->second = h;
        return;
      }
    }
  });
  std::lock_guard<std::mutex> lock(found->first);
  return found->second;
}

std::vector<std::string> CrossHostFailures::otherHosts() const {
  std::vector<std::string> hosts;
  for (const auto& id : nodeIds_) {
    if (id != nodeIds_[rank_] && std::find(hosts.begin(), hosts.end(), id) == hosts.end()) hosts.push_back(id);
  }
  return hosts;
}

std::string CrossHostFailures::hostsWhere(const std::function<bool(const std::string&)>& include,
                                          std::vector<std::string>* ids) const {
  std::string out;
  const bool global = !globalRanks_.empty();
  if (ids) ids->clear();
  for (const auto& id : otherHosts()) {
    if (!include(id)) continue;
    if (ids) ids->push_back(id);
    std::string ranks;
    for (size_t r = 0; r < nodeIds_.size(); ++r) {
      if (nodeIds_[r] == id) ranks += str(ranks.empty() ? "" : ", ", global ? globalRanks_[r] : static_cast<int64_t>(r));
    }
    out += str(out.empty() ? "" : " and ", "host '", id, "' (", global ? "global " : "", "ranks [", ranks, "])");
  }
  return out;
}

std::string CrossHostFailures::explain(const std::exception& e, const WaitContext& ctx,
                                       std::vector<std::string>* named) const {
  const std::string gloo = firstLine(e);
  std::vector<std::string> ids;  // the hosts the message names as failed or silent
  auto every = [](const std::string&) { return true; };
  auto ranksOf = [&](const std::string& host) { return hostsWhere([&](const std::string& h) { return h == host; }); };
  std::string msg = str("tdx: ", ctx.op, " (sequence ", ctx.seq, ") failed in its cross-host part: ");
  const bool timeout = contains(gloo, "timed out") || contains(gloo, "timeout");
  // Every failing rank leaves a mark: the hosts whose ranks failed too still reach the store.
  postMark(ctx.seq, timeout);
  Heard heard;
  auto anyRank = [&](const std::vector<bool>& of, const std::string& host) {
    for (size_t r = 0; r < nodeIds_.size(); ++r) {
      if (nodeIds_[r] == host && of[r]) return true;
    }
    return false;
  };
  auto marked = [&](const std::string& host) { return anyRank(heard.marked, host); };
  auto timedOutThere = [&](const std::string& host) { return anyRank(heard.timedOut, host); };
  auto everyOtherHostTimedOut = [&] {
    return hostsWhere([&](const std::string& h) { return !timedOutThere(h); }).empty();
  };
  std::string from;  // the host whose ranks' notes are quoted ("": every rank's)
  if (timeout) {
    // Named: the hosts that left no mark; where none did (this host cannot reach the store, or
    // every other host is cut off), every other host.
    heard = listen(ctx.seq, failureWaits().mark, Until::kEveryHostMarked);
    const std::string silent = hostsWhere([&](const std::string& h) { return !marked(h); }, &ids);
    const std::string reported = hostsWhere(marked);
    msg += str("no answer from ", silent.empty() ? hostsWhere(every, &ids) : silent, " within ", ctx.timeout.count() / 1000.0,
               " s: the network between the hosts is down, or those ranks stopped or hung");
    if (silent.empty()) {
      // The others may have failed on a connection this rank's own timeout closed.
      msg += str(" (every other host's ranks ", everyOtherHostTimedOut() ? "timed out on it" : "failed in it",
                 " too, so ", kSuggestMismatch, ")");
    } else if (!reported.empty()) {
      msg += str(" (", reported, " timed out on it too, so only ",
                 silent.find(" and host ") == std::string::npos ? "that host" : "those hosts", " may be cut off)");
    }
  } else if (contains(gloo, "closed") || contains(gloo, "reset") || contains(gloo, "refused") ||
             contains(gloo, "broken pipe")) {
    // The host of the address Gloo names closed the connection. If its ranks failed in this
    // operation themselves, that host only passed a failure on: a note says from where. Where every
    // other host's ranks timed out in it (Gloo closes a connection whose wait timed out), they
    // waited for this host as it waited for them, as on a timeout here.
    const std::string peer = hostOfAddress(gloo);
    heard = listen(ctx.seq, failureWaits().note, Until::kAnyNote);
    if (peer.empty()) {
      hostsWhere(every, &ids);
    } else {
      ids = {peer};
    }
    bool peerNoted = false;  // a rank of the peer's host said why it failed
    for (const auto& [r, note] : heard.notes) peerNoted = peerNoted || nodeIds_[r] == peer;
    if (everyOtherHostTimedOut()) {
      msg += str(peer.empty() ? hostsWhere(every) : ranksOf(peer),
                 " closed the connection after timing out in this operation (every other host timed out on it, so ",
                 kSuggestMismatch, ")");
      from = peer;
    } else if (peer.empty()) {
      msg += str(hostsWhere(every),
                 " closed the connection: ranks there exited or were killed, or their host went down");
    } else if (marked(peer) && peerNoted) {
      msg += str(ranksOf(peer), " closed the connection after failing in this operation itself");
      from = peer;
    } else if (marked(peer)) {
      // Its ranks failed in this operation but none said why: a rank there died and its host mates
      // failed on that (and may have died since: a host that went down takes them all).
      msg += str(ranksOf(peer), " closed the connection: ranks there failed in this operation without a note, "
                 "as when a rank there exited or was killed, or the host went down");
    } else {
      msg += str(ranksOf(peer), " closed the connection: ranks there exited or were killed, or the host went down");
      // For the ranks that see this rank's connections close next; not waited for (the store may
      // have been on the host that went down).
      post(msg, std::chrono::milliseconds(0));
    }
  } else {
    heard = listen(ctx.seq, failureWaits().note, Until::kAnyNote);
    msg += str("the Gloo transfer to ", hostsWhere(every, &ids), " failed");
  }
  if (named) *named = ids;
  msg += str(" (Gloo: ", gloo, ")");
  std::vector<std::string> quoted;
  for (const auto& [r, note] : heard.notes) {
    if (from.empty()) quoted.push_back(note);
  }
  if (!from.empty() && !heard.notes.empty()) {
    // One note: that host's, else any (the ranks that saw the first connection close name its host;
    // with failures passed along a ring of hosts, the host that closed on this rank may have none).
    quoted.push_back(heard.notes.front().second);
    for (const auto& [r, note] : heard.notes) {
      if (nodeIds_[r] == from) {
        quoted.back() = note;
        break;
      }
    }
  }
  for (const auto& note : quoted) msg += str("; ", note);
  if (quoted.empty()) msg += ".";
  return msg;
}

}  // namespace tdx
