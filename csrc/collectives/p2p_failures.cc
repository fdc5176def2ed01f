// The p2p engine's failure paths: timeouts, receives that do not match what was sent, broken
// rings and dead peers, shutdown. Each names the operation, the peer and what to do.
#include "collectives/p2p.h"

#include "common/logging.h"

namespace tdx {

namespace {

const char* brokenWhy(uint32_t code) {
  return code == shm::kSenderAbandoned
             ? "a message in it was abandoned half-written (its send timed out or the sender failed)"
             : "a message in it was abandoned half-read (its receive timed out or the receiver failed)";
}

// Marks the ring broken (first cause wins) and rings the peer so it notices.
void markBroken(shm::ShmGroup& g, int src, int dst, uint32_t code) {
  uint32_t none = 0;
  g.ringCtl(src, dst).broken.compare_exchange_strong(none, code);
  shm::ring(g.bell(src == g.rank() ? dst : src));
}

}  // namespace

std::string P2PEngine::dtypeName(int dtype) const {
  if (dtype < 0) return "untyped bytes";
  return dtypeName_ ? dtypeName_(dtype) : str("dtype code ", dtype);
}

std::string P2PEngine::rejectedWhy(const shm::RingCtl& ctl, int src, int dst) const {
  const auto& r = ctl.rejected;
  return str("rank ", g_.info().describeRank(src), " sent a message (tag ", r.tag, ") of ", r.sentBytes, " bytes of ",
             dtypeName(r.sentDtype), " but rank ", g_.info().describeRank(dst), " received it into a tensor of ",
             r.recvBytes, " bytes of ", dtypeName(r.recvDtype),
             "; the sent and received tensors must have the same dtype and number of elements");
}

void P2PEngine::reject(std::unique_ptr<Op> op, int src, int tag, int sentDtype, uint64_t sentBytes) {
  shm::RingCtl& ctl = g_.ringCtl(src, g_.rank());
  if (ctl.broken.load(std::memory_order_acquire) == 0) {
    ctl.rejected.tag = tag;
    ctl.rejected.sentDtype = sentDtype;
    ctl.rejected.recvDtype = op->dtype;
    ctl.rejected.sentBytes = sentBytes;
    ctl.rejected.recvBytes = op->bytes;
    markBroken(g_, src, g_.rank(), shm::kReceiverRejected);
  }
  const uint32_t code = ctl.broken.load(std::memory_order_acquire);
  const std::string why = code == shm::kReceiverRejected ? rejectedWhy(ctl, src, g_.rank()) : brokenWhy(code);
  const GroupInfo& info = g_.info();
  std::string msg = str("tdx: ", op->ctx.op, " (sequence ", op->ctx.seq, ", tag ", tag, ") in group '", info.name,
                        "' failed on rank ", info.describeRank(g_.rank()), ": ", why,
                        ". Destroy the process group and create a new one");
  finish(std::move(op), std::make_exception_ptr(Error(msg)));
}

void P2PEngine::failExpired() {
  const auto now = std::chrono::steady_clock::now();
  auto expired = [&](const Op& op) { return now >= op.ctx.deadline; };
  auto timeoutError = [&](const Op& op) {
    return std::make_exception_ptr(TimeoutError(str(
        "tdx: ", op.ctx.op, " (sequence ", op.ctx.seq, ", tag ", op.tag, ") in group '", g_.info().name,
        "' timed out after ", op.ctx.timeout.count(), " ms on rank ", g_.info().describeRank(g_.rank()), ": ",
        op.isSend ? str("rank ", g_.info().describeRank(op.peer), " did not receive the data")
                  : (op.peer < 0 ? std::string("no rank sent a matching message")
                                 : str("rank ", g_.info().describeRank(op.peer), " did not send a matching message")),
        ". It may have crashed, be stuck, or use a different tag or size")));
  };
  for (auto& q : sends_) {
    // Only the head of a queue may be partly written; later sends expire with it.
    while (!q.empty() && expired(*q.front())) {
      auto op = std::move(q.front());
      q.pop_front();
      auto err = timeoutError(*op);
      if (op->headerDone && op->moved < op->bytes) {
        // The receiver would take the next message's bytes for the rest of this one.
        markBroken(g_, g_.rank(), op->peer, shm::kSenderAbandoned);
        err = std::make_exception_ptr(TimeoutError(str(
            "tdx: ", op->ctx.op, " (sequence ", op->ctx.seq, ", tag ", op->tag, ") in group '", g_.info().name,
            "' timed out after ", op->ctx.timeout.count(), " ms on rank ", g_.info().describeRank(g_.rank()),
            " having written ", op->moved, " of ", op->bytes, " bytes: rank ", g_.info().describeRank(op->peer),
            " did not receive the data. The channel to it is now broken (a half-written message cannot be taken back); "
            "later sends to it fail. Destroy the process group and create a new one")));
      }
      finish(std::move(op), err);
    }
  }
  for (auto it = recvs_.begin(); it != recvs_.end();) {
    int activeSrc = -1;
    for (int s = 0; s < g_.size(); ++s) {
      if (channels_[s].active == it->get()) activeSrc = s;
    }
    if (!expired(**it)) {
      ++it;
      continue;
    }
    auto op = std::move(*it);
    it = recvs_.erase(it);
    auto err = timeoutError(*op);
    if (activeSrc >= 0) {
      // Half-filled: the sender stalled mid-message. Its remaining bytes would land in the next
      // receive, so the channel from it is broken from now on.
      channels_[activeSrc].active = nullptr;
      markBroken(g_, activeSrc, g_.rank(), shm::kReceiverAbandoned);
      err = std::make_exception_ptr(TimeoutError(str(
          "tdx: ", op->ctx.op, " (sequence ", op->ctx.seq, ", tag ", op->tag, ") in group '", g_.info().name,
          "' timed out after ", op->ctx.timeout.count(), " ms on rank ", g_.info().describeRank(g_.rank()),
          " having received ", op->moved, " of ", op->bytes, " bytes: rank ", g_.info().describeRank(activeSrc),
          " stopped sending in the middle of the message. The channel from it is now broken; later receives "
          "from it fail. Destroy the process group and create a new one")));
    }
    finish(std::move(op), err);
  }
}

void P2PEngine::failBrokenAndDead(const std::vector<std::string>& dead) {
  const int me = g_.rank();
  const GroupInfo& info = g_.info();
  auto fail = [&](std::unique_ptr<Op> op, std::exception_ptr err) { finish(std::move(op), err); };
  for (int dst = 0; dst < g_.size(); ++dst) {
    auto& q = sends_[dst];
    if (q.empty()) continue;
    const uint32_t code = g_.ringCtl(me, dst).broken.load(std::memory_order_acquire);
    if (!code && dead[dst].empty()) continue;
    while (!q.empty()) {
      auto op = std::move(q.front());
      q.pop_front();
      std::string why = code == shm::kReceiverRejected ? rejectedWhy(g_.ringCtl(me, dst), me, dst)
                        : code ? str("the channel to rank ", info.describeRank(dst), " is broken: ", brokenWhy(code))
                             : str(dead[dst], " before receiving it");
      if (!code && op->headerDone && op->moved < op->bytes) markBroken(g_, me, dst, shm::kSenderAbandoned);
      auto err = code ? std::make_exception_ptr(Error(str("tdx: ", op->ctx.op, " (sequence ", op->ctx.seq, ", tag ",
                                                          op->tag, ") in group '", info.name, "' failed on rank ",
                                                          info.describeRank(me), ": ", why,
                                                          ". Destroy the process group and create a new one")))
                      : std::make_exception_ptr(PeerFailedError(str(
                            "tdx: ", op->ctx.op, " (sequence ", op->ctx.seq, ", tag ", op->tag, ") in group '",
                            info.name, "' failed on rank ", info.describeRank(me), ": ", why)));
      fail(std::move(op), err);
    }
  }
  bool allDead = true;
  for (int s = 0; s < g_.size(); ++s) allDead &= s == me || !dead[s].empty();
  for (auto it = recvs_.begin(); it != recvs_.end();) {
    Op& r = **it;
    int src = r.matchedSrc >= 0 ? r.matchedSrc : r.peer;
    uint32_t code = 0;
    std::string why;
    if (src >= 0) {
      code = g_.ringCtl(src, me).broken.load(std::memory_order_acquire);
      if (code) {
        why = code == shm::kReceiverRejected ? rejectedWhy(g_.ringCtl(src, me), src, me)
                                             : str("the channel from rank ", info.describeRank(src), " is broken: ",
                                                   brokenWhy(code));
      } else if (!dead[src].empty()) {
        why = str(dead[src], r.headerDone ? " in the middle of sending the message" : " before sending a matching message");
      }
    } else if (allDead && g_.size() > 1) {
      for (int s = 0; s < g_.size(); ++s) {
        if (s != me) why += (why.empty() ? "" : "; ") + dead[s];
      }
      why = "every other rank exited before sending a matching message: " + why;
    }
    if (why.empty()) {
      ++it;
      continue;
    }
    if (src >= 0 && channels_[src].active == it->get()) {
      channels_[src].active = nullptr;
      markBroken(g_, src, me, shm::kReceiverAbandoned);
    }
    auto op = std::move(*it);
    it = recvs_.erase(it);
    std::string msg = str("tdx: ", op->ctx.op, " (sequence ", op->ctx.seq, ", tag ", op->tag, ") in group '",
                          info.name, "' failed on rank ", info.describeRank(me), ": ", why);
    fail(std::move(op), code ? std::make_exception_ptr(Error(msg + ". Destroy the process group and create a new one"))
                             : std::make_exception_ptr(PeerFailedError(msg)));
  }
}

void P2PEngine::failAll(std::exception_ptr err) {
  std::vector<std::unique_ptr<Op>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& op : incoming_) all.push_back(std::move(op));
    incoming_.clear();
  }
  for (auto& q : sends_) {
    for (auto& op : q) all.push_back(std::move(op));
    q.clear();
  }
  for (auto& op : recvs_) all.push_back(std::move(op));
  recvs_.clear();
  for (auto& ch : channels_) ch.active = nullptr;
  for (auto& op : all) finish(std::move(op), err);
}

}  // namespace tdx
