// What a rank says when the cross-host (Gloo) part of an operation fails: one sentence naming the
// operation, its sequence number, the hosts and ranks it was waiting for and why, plus a cause
// another rank reported, where one arrives in time. Nothing here waits without a deadline: the
// store may live on a host that can no longer be reached.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <exception>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace tdx {

class CrossHostFailures {
 public:
  // nodeIds[r]: the host of group rank r; globalRanks: group rank -> global rank (empty: the same).
  CrossHostFailures(c10::intrusive_ptr<c10d::Store> store, int rank, std::vector<std::string> nodeIds,
                    std::vector<int64_t> globalRanks);

  // Leaves a note for the other hosts' ranks, whose Gloo connections merely close or time out
  // (e.g. "rank 3 (pid 42) exited"); gives up after kPostWait.
  void post(const std::string& what) const;

  // The error for a failed wait on a Gloo operation (`e` what it raised), with notes other ranks
  // left within kNoteWait.
  std::string explain(const std::exception& e, const WaitContext& ctx) const;

  // How long a failing rank waits for another rank's note, and for its own note to be stored.
  static constexpr std::chrono::milliseconds kNoteWait{800};
  static constexpr std::chrono::milliseconds kPostWait{500};

 private:
  std::vector<std::string> notes() const;
  std::string otherHosts() const;  // "host 'hostB' (ranks [2, 3])", every host but this rank's

  c10::intrusive_ptr<c10d::Store> store_;
  int rank_;
  std::vector<std::string> nodeIds_;
  std::vector<int64_t> globalRanks_;
};

// The first line of an exception's message, without torch's C++ stack trace.
std::string firstLine(const std::exception& e);

}  // namespace tdx
