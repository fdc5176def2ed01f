// Test helpers: ranks as threads of one process.
//
// InMemoryRendezvous is the Rendezvous of the transport seam backed by a map; spawnThreads runs
// one function per rank on its own thread and rethrows the first exception; runGroup also gives
// every rank its own ShmGroup (real POSIX shm segments, unlinked once all ranks mapped them).
#pragma once

#include <dirent.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/logging.h"
#include "transport/shm/shm_group.h"
#include "transport/transport.h"

namespace tdx::test {

class InMemoryRendezvous : public Rendezvous {
 public:
  explicit InMemoryRendezvous(std::chrono::milliseconds timeout = std::chrono::seconds(10)) : timeout_(timeout) {}

  void set(const std::string& key, const std::string& value) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      map_[key] = value;
    }
    cv_.notify_all();
  }

  std::string get(const std::string& key) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, timeout_, [&] { return map_.count(key) != 0; })) {
      throw Error(str("InMemoryRendezvous: timed out after ", timeout_.count(), " ms waiting for key '", key, "'"));
    }
    return map_[key];
  }

 private:
  std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> map_;
};

// Runs fn(rank) for rank in [0, n) on n threads, joins them all, then rethrows the first
// exception any of them raised (first in time, not in rank order).
inline void spawnThreads(int n, const std::function<void(int)>& fn) {
  std::mutex mu;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

// Options that force multi-round paths on small inputs: the smallest buffer half and ring.
inline shm::ShmOptions smallOptions() {
  shm::ShmOptions o;
  o.halfBytes = 4096;
  o.ringBytes = 4096;
  return o;
}

inline GroupInfo groupInfo(int rank, int size, const std::string& name = "test") {
  GroupInfo info;
  info.rank = rank;
  info.size = size;
  info.name = name;
  return info;
}

// Runs fn(group) on n threads, each with its own ShmGroup of the same group.
inline void runGroup(int n, const shm::ShmOptions& opts, const std::function<void(shm::ShmGroup&)>& fn) {
  InMemoryRendezvous rdv;
  spawnThreads(n, [&](int rank) {
    shm::ShmGroup g(groupInfo(rank, n), rdv, opts);
    fn(g);
  });
}

// A WaitContext for operation `op` number `seq` that times out after `timeout`.
inline WaitContext ctxFor(const char* op, uint64_t seq,
                          std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  return waitFromNow(op, seq, timeout);
}

// Names in /dev/shm created by this process's tdx segments.
inline std::vector<std::string> ownShmEntries() {
  std::vector<std::string> found;
  const std::string prefix = str(shm::kSegmentPrefix, getpid(), "-");
  if (DIR* dir = opendir("/dev/shm")) {
    while (dirent* e = readdir(dir)) {
      if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0) found.push_back(e->d_name);
    }
    closedir(dir);
  }
  return found;
}

// Deterministic random bytes.
inline std::vector<char> randomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<char> v(n);
  for (auto& c : v) c = static_cast<char>(rng());
  return v;
}

}  // namespace tdx::test
