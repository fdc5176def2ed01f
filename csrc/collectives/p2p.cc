#include "collectives/p2p.h"

#include <algorithm>
#include <cstring>

#include "collectives/chunking.h"
#include "common/logging.h"

namespace tdx {

namespace {

constexpr size_t kHeader = 16;
constexpr uint16_t kMsgMagic = 0x7470;  // "tp"

struct MsgHeader {
  int32_t tag;
  uint16_t magic;
  int16_t dtype;  // the sender's dtype code, -1 for untyped bytes
  uint64_t bytes;
};
static_assert(sizeof(MsgHeader) == kHeader, "header is 16 bytes");

// Copies n bytes into the ring at logical position pos (may wrap).
void ringWrite(char* ring, size_t cap, uint64_t pos, const char* src, size_t n) {
  size_t at = pos % cap;
  size_t first = std::min(n, cap - at);
  std::memcpy(ring + at, src, first);
  if (first < n) std::memcpy(ring, src + first, n - first);
}

void ringRead(const char* ring, size_t cap, uint64_t pos, char* dst, size_t n) {
  size_t at = pos % cap;
  size_t first = std::min(n, cap - at);
  std::memcpy(dst, ring + at, first);
  if (first < n) std::memcpy(dst + first, ring, n - first);
}

}  // namespace

P2PEngine::P2PEngine(shm::ShmGroup& g, DtypeName dtypeName)
    : g_(g), dtypeName_(std::move(dtypeName)), sends_(g.size()), channels_(g.size()) {
  thread_ = std::thread([this] { loop(); });
}

P2PEngine::~P2PEngine() { shutdown(); }

void P2PEngine::send(const void* data, size_t bytes, int dst, int tag, const WaitContext& ctx, Done done, int dtype) {
  g_.checkNotExcluded(ctx);
  g_.noteProgress();
  TDX_ENFORCE(dst >= 0 && dst < g_.size() && dst != g_.rank(), "send: destination rank ", dst,
              " is invalid for rank ", g_.rank(), " in a group of size ", g_.size());
  auto op = std::make_unique<Op>(Op{true, static_cast<char*>(const_cast<void*>(data)), bytes, dst, tag, ctx,
                                    std::move(done)});
  op->dtype = dtype;
  {
    std::lock_guard<std::mutex> lock(mu_);
    TDX_ENFORCE(!stopped_, "send on a process group that was shut down");
    incoming_.push_back(std::move(op));
  }
  shm::ring(g_.bell(g_.rank()));
}

void P2PEngine::recv(void* data, size_t bytes, int src, int tag, const WaitContext& ctx, Done done, int dtype) {
  g_.checkNotExcluded(ctx);
  g_.noteProgress();
  TDX_ENFORCE(src >= -1 && src < g_.size() && src != g_.rank(), "recv: source rank ", src,
              " is invalid for rank ", g_.rank(), " in a group of size ", g_.size());
  auto op = std::make_unique<Op>(Op{false, static_cast<char*>(data), bytes, src, tag, ctx, std::move(done)});
  op->dtype = dtype;
  {
    std::lock_guard<std::mutex> lock(mu_);
    TDX_ENFORCE(!stopped_, "recv on a process group that was shut down");
    incoming_.push_back(std::move(op));
  }
  shm::ring(g_.bell(g_.rank()));
}

void P2PEngine::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  stop_.store(true);
  shm::ring(g_.bell(g_.rank()));
  if (thread_.joinable()) thread_.join();
}

void P2PEngine::finish(std::unique_ptr<Op> op, std::exception_ptr err) {
  if (op->done) op->done(err, op->isSend ? g_.rank() : op->matchedSrc);
}

bool P2PEngine::progressSend(Op& op) {
  const int me = g_.rank();
  shm::RingCtl& ctl = g_.ringCtl(me, op.peer);
  char* ring = g_.ringData(me, op.peer);
  const size_t cap = g_.ringBytes();
  uint64_t head = ctl.head.load(std::memory_order_relaxed);
  const uint64_t tail = ctl.tail.load(std::memory_order_acquire);
  size_t space = cap - static_cast<size_t>(head - tail);
  bool progressed = false;
  if (!op.headerDone) {
    if (space < kHeader) return false;
    MsgHeader hdr{op.tag, kMsgMagic, static_cast<int16_t>(op.dtype), op.bytes};
    ringWrite(ring, cap, head, reinterpret_cast<const char*>(&hdr), kHeader);
    head += kHeader;
    space -= kHeader;
    op.headerDone = progressed = true;
  }
  while (op.moved < op.bytes && space > 0) {
    size_t n = std::min({op.bytes - op.moved, space, cap - static_cast<size_t>(head % cap)});
    std::memcpy(ring + head % cap, op.data + op.moved, n);
    head += n;
    space -= n;
    op.moved += n;
    progressed = true;
  }
  if (op.moved == op.bytes) head = roundUp(head, kHeader);
  if (progressed) {
    ctl.head.store(head, std::memory_order_release);
    shm::ring(g_.bell(op.peer));
  }
  return progressed;
}

P2PEngine::Placed P2PEngine::placeMessage(Channel& ch, int src, int tag, int dtype, uint64_t bytes) {
  // The earliest message with this tag from src may be stashed; then this one must wait.
  bool olderStashed = false;
  for (auto& s : ch.stash) olderStashed |= s->tag == tag;
  auto match = recvs_.end();
  bool anyWaiting = false;
  for (auto it = recvs_.begin(); it != recvs_.end(); ++it) {
    Op& r = **it;
    // headerDone: already being filled from some channel (a receive from any source).
    if (r.headerDone || (r.peer != src && r.peer != -1)) continue;
    anyWaiting = true;
    if (r.tag == tag && !olderStashed) {
      match = it;
      break;
    }
  }
  if (match != recvs_.end()) {
    Op* op = match->get();
    if (op->bytes != bytes || op->dtype != dtype) {
      auto owned = std::move(*match);
      recvs_.erase(match);
      reject(std::move(owned), src, tag, dtype, bytes);
      return Placed::kRejected;
    }
    op->matchedSrc = src;
    ch.active = op;
    op->headerDone = true;
    return Placed::kPlaced;
  }
  if (!anyWaiting) return Placed::kWait;
  // A receive from this source waits for another tag: move this message out of the way.
  ch.stash.push_back(std::make_unique<Stashed>(Stashed{tag, dtype, std::vector<char>(bytes)}));
  ch.activeStash = ch.stash.back().get();
  return Placed::kPlaced;
}

bool P2PEngine::progressChannel(int src) {
  const int me = g_.rank();
  Channel& ch = channels_[src];
  shm::RingCtl& ctl = g_.ringCtl(src, me);
  const char* ring = g_.ringData(src, me);
  const size_t cap = g_.ringBytes();
  uint64_t tail = ctl.tail.load(std::memory_order_relaxed);
  const uint64_t head = ctl.head.load(std::memory_order_acquire);
  bool progressed = false;
  while (true) {
    if (!ch.active && !ch.activeStash) {
      if (head - tail < kHeader) break;
      MsgHeader hdr;
      ringRead(ring, cap, tail, reinterpret_cast<char*>(&hdr), kHeader);
      TDX_CHECK_EQ(hdr.magic, kMsgMagic);
      const Placed placed = placeMessage(ch, src, hdr.tag, hdr.dtype, hdr.bytes);
      if (placed == Placed::kRejected) {
        progressed = true;
        break;  // the ring is broken: nothing more is read from it
      }
      if (placed == Placed::kWait) break;
      tail += kHeader;
      progressed = true;
    }
    char* dst = ch.active ? ch.active->data : ch.activeStash->data.data();
    size_t& moved = ch.active ? ch.active->moved : ch.activeStash->moved;
    const size_t want = ch.active ? ch.active->bytes : ch.activeStash->data.size();
    while (moved < want && head > tail) {
      size_t n = std::min({want - moved, static_cast<size_t>(head - tail), cap - static_cast<size_t>(tail % cap)});
      std::memcpy(dst + moved, ring + tail % cap, n);
      tail += n;
      moved += n;
      progressed = true;
    }
    if (moved < want) break;
    tail = roundUp(tail, kHeader);
    if (ch.active) {
      Op* done = ch.active;
      ch.active = nullptr;
      auto it = std::find_if(recvs_.begin(), recvs_.end(), [&](auto& p) { return p.get() == done; });
      auto owned = std::move(*it);
      recvs_.erase(it);
      finish(std::move(owned), nullptr);
    } else {
      ch.activeStash = nullptr;
    }
    progressed = true;
  }
  if (progressed) {
    ctl.tail.store(tail, std::memory_order_release);
    shm::ring(g_.bell(src));
  }
  return progressed;
}

bool P2PEngine::matchStashes() {
  bool progressed = false;
  for (auto it = recvs_.begin(); it != recvs_.end();) {
    Op& r = **it;
    bool taken = false;
    if (r.headerDone) {  // being filled from a ring already
      ++it;
      continue;
    }
    for (int s = 0; s < g_.size() && !taken; ++s) {
      if (r.peer != -1 && r.peer != s) continue;
      Channel& ch = channels_[s];
      for (auto st = ch.stash.begin(); st != ch.stash.end(); ++st) {
        if ((*st)->tag != r.tag) continue;
        if (!(*st)->complete()) break;  // the earliest one is still arriving
        auto owned = std::move(*it);
        it = recvs_.erase(it);
        owned->matchedSrc = s;
        if ((*st)->data.size() != owned->bytes || (*st)->dtype != owned->dtype) {
          const int sentDtype = (*st)->dtype;
          const uint64_t sentBytes = (*st)->data.size();
          ch.stash.erase(st);
          reject(std::move(owned), s, r.tag, sentDtype, sentBytes);
        } else {
          std::memcpy(owned->data, (*st)->data.data(), owned->bytes);
          ch.stash.erase(st);
          finish(std::move(owned), nullptr);
        }
        taken = progressed = true;
        break;
      }
    }
    if (!taken) ++it;
  }
  return progressed;
}

bool P2PEngine::awaits(int peer) const {
  if (!sends_[peer].empty()) return true;
  for (const auto& r : recvs_) {
    const int src = r->matchedSrc >= 0 ? r->matchedSrc : r->peer;
    if (src == peer || src < 0) return true;
  }
  return false;
}

void P2PEngine::loop() {
  shm::Doorbell& bell = g_.bell(g_.rank());
  // Peers' liveness is probed (a few system calls) at most every kProbeEvery while operations wait.
  constexpr auto kProbeEvery = std::chrono::milliseconds(10);
  auto nextProbe = std::chrono::steady_clock::now();
  std::vector<std::string> dead(g_.size());
  const std::vector<std::string> noneDead(g_.size());
  bool pending = false;
  while (!stop_.load()) {
    const uint32_t seen = bell.word.load(std::memory_order_seq_cst);
    bool progressed = false;
    // Probe before progressing: bytes a peer wrote before it died are then visible and used.
    bool probed = false;
    if (pending && std::chrono::steady_clock::now() >= nextProbe) {
      g_.noteProgress();  // waiting on peers is progress
      if (!g_.excludedWhy(g_.rank()).empty()) {
        try {
          g_.checkNotExcluded(WaitContext{"p2p operation"});
        } catch (...) {
          failAll(std::current_exception());
        }
        pending = false;
        continue;
      }
      for (int p = 0; p < g_.size(); ++p) {
        dead[p] = g_.peerDeath(p);
        if (dead[p].empty() && awaits(p)) dead[p] = g_.peerStuck(p);  // silent past the stuck time
        if (dead[p].empty()) dead[p] = g_.peerAborted(p);  // it left: nothing more comes or goes
      }
      nextProbe = std::chrono::steady_clock::now() + kProbeEvery;
      probed = true;
    }
    pending = false;
    try {
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (auto& op : incoming_) {
          if (op->isSend) {
            sends_[op->peer].push_back(std::move(op));
          } else {
            recvs_.push_back(std::move(op));
          }
        }
        progressed = !incoming_.empty();
        incoming_.clear();
      }
      progressed |= matchStashes();
      for (int dst = 0; dst < g_.size(); ++dst) {
        auto& q = sends_[dst];
        if (g_.ringCtl(g_.rank(), dst).broken.load(std::memory_order_acquire)) continue;
        while (!q.empty() && progressSend(*q.front())) {
          progressed = true;
          if (q.front()->moved < q.front()->bytes) break;
          auto op = std::move(q.front());
          q.pop_front();
          finish(std::move(op), nullptr);
        }
      }
      // Rotate the starting source so receives from any source are fair.
      for (int i = 0; i < g_.size(); ++i) {
        int src = (anyStart_ + i) % g_.size();
        if (src != g_.rank() && !g_.ringCtl(src, g_.rank()).broken.load(std::memory_order_acquire)) {
          progressed |= progressChannel(src);
        }
      }
      anyStart_ = (anyStart_ + 1) % g_.size();
      failExpired();
      if (probed) {
        failBrokenAndDead(dead);
      } else {
        failBrokenAndDead(noneDead);
      }
    } catch (...) {
      failAll(std::current_exception());
      continue;
    }
    for (auto& q : sends_) pending |= !q.empty();
    pending |= !recvs_.empty();
    if (progressed) continue;
    shm::WaitPolicy policy = g_.options().wait;
    if (!pending) policy.spinTime = policy.yieldTime = std::chrono::microseconds(0);
    // Short naps while operations wait, so timeouts and dead peers are noticed promptly.
    shm::waitUntil([&] { return bell.word.load(std::memory_order_acquire) != seen || stop_.load(); }, bell,
                   std::chrono::steady_clock::now() + std::chrono::milliseconds(pending ? 10 : 100), nullptr,
                   policy);
  }
  failAll(std::make_exception_ptr(AbortedError(
      str("tdx: point-to-point operation aborted: the process group '", g_.info().name, "' was shut down"))));
}

}  // namespace tdx
