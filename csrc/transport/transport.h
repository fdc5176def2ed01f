// The transport seam: what a transport needs from the outside world.
// No torch types here, so transports can be tested alone (ranks as threads).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace tdx {

// Key/value exchange used once, while a group is set up (the c10d store in the backend,
// an in-memory map in C++ tests). get() blocks until the key exists or throws on timeout.
class Rendezvous {
 public:
  virtual ~Rendezvous() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  virtual std::string get(const std::string& key) = 0;
};

// Identifies a running operation in errors: its name, sequence number and deadline.
struct WaitContext {
  const char* op = "operation";
  uint64_t seq = 0;
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  std::chrono::milliseconds timeout{0};
};

// The wait context of operation `op` number `seq` starting now, timing out after `timeout`.
inline WaitContext waitFromNow(const char* op, uint64_t seq, std::chrono::milliseconds timeout) {
  WaitContext ctx;
  ctx.op = op;
  ctx.seq = seq;
  ctx.timeout = timeout;
  ctx.deadline = std::chrono::steady_clock::now() + timeout;
  return ctx;
}

// Who the ranks of a group are, for messages ("rank 2 (global rank 6)").
struct GroupInfo {
  int rank = 0;
  int size = 1;
  std::string name = "default";
  std::vector<int64_t> globalRanks;  // empty: the same as group ranks
  std::string describeRank(int r) const;
  std::string describeRanks(const std::vector<int>& ranks) const;
};

}  // namespace tdx
