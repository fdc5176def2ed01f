// Point-to-point messages over per-pair shared-memory rings, progressed by one thread.
//
// Each (src, dst) pair has a byte ring in src's segment. A message is a 16-byte header
// (tag, size) and its payload, streamed through the ring as space frees up, so messages of any
// size pass through a fixed ring. Sends and receives are state machines advanced together by
// the engine's thread: a symmetric exchange of large messages never deadlocks. Messages between
// a pair keep their order; a receive takes the earliest message from its source with its tag,
// stashing earlier messages with other tags when a receive is waiting behind them.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/shm/shm_group.h"

namespace tdx {

class P2PEngine {
 public:
  // Called once per operation on the engine thread: err is null on success; srcRank is the
  // sender (useful for receives from any source).
  using Done = std::function<void(std::exception_ptr err, int srcRank)>;

  // Names a dtype code passed to send/recv in error messages (e.g. torch's ScalarType names).
  using DtypeName = std::function<std::string(int dtype)>;

  explicit P2PEngine(shm::ShmGroup& g, DtypeName dtypeName = {});
  ~P2PEngine();
  P2PEngine(const P2PEngine&) = delete;
  P2PEngine& operator=(const P2PEngine&) = delete;

  // dtype: a code (>= 0) that the receive's must equal, or -1 for untyped bytes. A receive whose
  // dtype or size differs from the message's fails, and breaks the pair's ring so the sender's
  // pending and later sends to that rank fail naming both sides.
  void send(const void* data, size_t bytes, int dst, int tag, const WaitContext& ctx, Done done, int dtype = -1);
  // src = -1 receives from any source.
  void recv(void* data, size_t bytes, int src, int tag, const WaitContext& ctx, Done done, int dtype = -1);

  // Fails every pending operation with AbortedError and stops the thread. Idempotent.
  void shutdown();

 private:
  struct Op {
    bool isSend;
    char* data;
    size_t bytes;
    int peer;  // dst for sends, src (or -1) for receives
    int tag;
    WaitContext ctx;
    Done done;
    size_t moved = 0;
    bool headerDone = false;
    int matchedSrc = -1;
    int dtype = -1;
  };
  struct Stashed {
    int tag;
    int dtype;
    std::vector<char> data;
    size_t moved = 0;
    bool complete() const { return moved == data.size(); }
  };
  struct Channel {  // receiving side of the ring from one source
    Op* active = nullptr;         // receive being filled from the ring
    Stashed* activeStash = nullptr;
    std::deque<std::unique_ptr<Stashed>> stash;
  };

  void loop();
  bool progressSend(Op& op);
  bool progressChannel(int src);
  // Where the message (tag, dtype, bytes) at the head of src's ring goes: a posted receive
  // (ch.active) or a stash (ch.activeStash). kWait: nobody wants it yet; kRejected: the matching
  // receive expected another dtype or size (it failed, and the ring is broken).
  enum class Placed { kPlaced, kWait, kRejected };
  Placed placeMessage(Channel& ch, int src, int tag, int dtype, uint64_t bytes);
  bool matchStashes();
  // Whether an operation of this rank waits on `peer` (a send to it, a receive from it or from any).
  bool awaits(int peer) const;
  void finish(std::unique_ptr<Op> op, std::exception_ptr err);
  void failExpired();
  // Fails operations on broken rings, and (with dead[p] = "rank p (pid ..) exited") those that can
  // no longer complete because their peer died.
  void failBrokenAndDead(const std::vector<std::string>& dead);
  void failAll(std::exception_ptr err);
  std::string dtypeName(int dtype) const;
  // A receive matched a message of another dtype or size: fails it and breaks the ring from src.
  void reject(std::unique_ptr<Op> op, int src, int tag, int sentDtype, uint64_t sentBytes);
  std::string rejectedWhy(const shm::RingCtl& ctl, int src, int dst) const;

  shm::ShmGroup& g_;
  DtypeName dtypeName_;
  std::mutex mu_;
  std::vector<std::unique_ptr<Op>> incoming_;  // posted by user threads, taken by the engine
  std::atomic<bool> stop_{false};
  bool stopped_ = false;
  // Engine-thread state.
  std::vector<std::deque<std::unique_ptr<Op>>> sends_;  // per destination, in posting order
  std::list<std::unique_ptr<Op>> recvs_;                 // posted receives, in posting order
  std::vector<Channel> channels_;                        // per source
  int anyStart_ = 0;
  std::thread thread_;
};

}  // namespace tdx
