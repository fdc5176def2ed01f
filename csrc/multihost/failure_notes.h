// What a rank says when the cross-host (Gloo) part of an operation fails: one sentence naming the
// operation, its sequence number, the hosts and ranks it was waiting for and why, plus a cause
// another rank reported, where one arrives in time. On a timeout each rank also leaves a mark in the
// store and looks for the other ranks' marks for a moment: the hosts that left none are the ones it
// names (with three hosts or more, a host whose link is down is then named alone by the others).
// When a connection closes, the host named is the one of the address Gloo gives; a host whose ranks
// failed in the operation first (and so closed their connections) is named with their note; where
// every other host timed out in it (Gloo closes the connection then), they waited for this host as
// it waited for them, and the message suggests a mismatch as on a timeout. Nothing here waits
// without a deadline: the store may live on a host that can no longer be reached.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <exception>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "common/failure_waits.h"
#include "transport/transport.h"

namespace tdx {

class CrossHostFailures {
 public:
  // nodeIds[r]: the host of group rank r; globalRanks: group rank -> global rank (empty: the same).
  // `interrupted` (may be null; outlives this): once set, nothing here waits for notes any longer
  // (the group was aborted or interrupted: the error says why already).
  CrossHostFailures(c10::intrusive_ptr<c10d::Store> store, int rank, std::vector<std::string> nodeIds,
                    std::vector<int64_t> globalRanks, const std::atomic<bool>* interrupted = nullptr);

  // Leaves a note for the other hosts' ranks, whose Gloo connections merely close or time out
  // (e.g. "rank 3 (pid 42) exited"); gives up waiting for the store after `wait`.
  void post(const std::string& what, std::chrono::milliseconds wait = failureWaits().post) const;

  // The error for a failed wait on a Gloo operation (`e` what it raised), with notes other ranks
  // left within failureWaits().note. `named`, when given, gets the node ids of the hosts the error names as
  // the ones that failed or went silent.
  std::string explain(const std::exception& e, const WaitContext& ctx,
                      std::vector<std::string>* named = nullptr) const;

  // How long a failing rank waits for another rank's note, for its own note to be stored, and (a
  // rank that timed out) for the other hosts' failure marks: failureWaits(), derived from
  // TDX_FAILURE_DETECTION_S (0.8 s, 0.5 s and 1.5 s at the default 5 s).
  // How long the host names are given to resolve, to find the host of the address Gloo names.
  static constexpr std::chrono::milliseconds kResolveWait{200};

 private:
  struct Heard {
    std::vector<std::pair<int, std::string>> notes;  // (group rank, note) of other ranks
    std::vector<bool> marked;                        // by group rank: failed in about this operation
    std::vector<bool> timedOut;                      // by group rank: timed out in this very operation
  };
  enum class Until { kEveryHostMarked, kAnyNote };
  // This rank failed in operation `seq` (its Gloo wait timed out: `timedOut`); not waited for.
  void postMark(uint64_t seq, bool timedOut) const;
  // Reads the other ranks' marks and notes until `until` holds (kAnyNote: also when every other
  // host has timed out in operation `seq`) or `wait` has passed.
  Heard listen(uint64_t seq, std::chrono::milliseconds wait, Until until) const;
  // The other host whose name resolves to the address in Gloo's message, or "".
  std::string hostOfAddress(const std::string& gloo) const;
  // "host 'hostB' (ranks [2, 3])" for each host but this rank's where `include(host)`; `ids`, when
  // given, gets those hosts' node ids.
  std::string hostsWhere(const std::function<bool(const std::string&)>& include,
                         std::vector<std::string>* ids = nullptr) const;
  // The other hosts' node ids, each once, in order of their lowest rank.
  std::vector<std::string> otherHosts() const;

  c10::intrusive_ptr<c10d::Store> store_;
  int rank_;
  std::vector<std::string> nodeIds_;
  std::vector<int64_t> globalRanks_;
  const std::atomic<bool>* interrupted_;
};

// Gone ranks across hosts: a rank that finds a host mate's process gone leaves "tdx/gone/<group
// rank>" in the group's store (`why` as the value), so the ranks of the other hosts, which only see
// their Gloo connections close, learn which rank it was. Neither waits on the store past `wait`.
void postGone(const c10::intrusive_ptr<c10d::Store>& store, int rank, const std::string& why,
              std::chrono::milliseconds wait);
// (group rank, why) for every rank of [0, size) with such a note; waits up to `wait` for the
// first note to arrive when none is there yet (`wait` 0: looks once).
std::vector<std::pair<int64_t, std::string>> readGone(const c10::intrusive_ptr<c10d::Store>& store, int size,
                                                      std::chrono::milliseconds wait);

// The first line of an exception's message, without torch's C++ stack trace.
std::string firstLine(const std::exception& e);

}  // namespace tdx
