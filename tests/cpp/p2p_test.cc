// P2PEngine over 4 KB rings: sizes around and far above the ring, symmetric exchanges, ordering,
// tags received out of posting order (stashing), any-source receives, size mismatch, timeouts.
#include "collectives/p2p.h"

#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "collectives/collectives.h"
#include "thread_ranks.h"

namespace tdx::test {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

struct Result {
  std::exception_ptr err;
  int src = -2;
  std::string error() const {  // the message, or empty on success
    if (!err) return "";
    try {
      std::rethrow_exception(err);
    } catch (const std::exception& e) {
      return e.what();
    }
  }
};

P2PEngine::Done into(std::shared_ptr<std::promise<Result>> p) {
  return [p](std::exception_ptr err, int src) { p->set_value(Result{err, src}); };
}

std::future<Result> sendAsync(P2PEngine& e, const std::vector<char>& v, int dst, int tag,
                              const WaitContext& ctx = ctxFor("send", 1), int dtype = -1) {
  auto p = std::make_shared<std::promise<Result>>();
  e.send(v.data(), v.size(), dst, tag, ctx, into(p), dtype);
  return p->get_future();
}

std::future<Result> recvAsync(P2PEngine& e, std::vector<char>& v, int src, int tag,
                              const WaitContext& ctx = ctxFor("recv", 1), int dtype = -1) {
  auto p = std::make_shared<std::promise<Result>>();
  e.recv(v.data(), v.size(), src, tag, ctx, into(p), dtype);
  return p->get_future();
}

// Waits for an operation; a future that never completes fails the test instead of hanging it.
Result await(std::future<Result>& f) {
  if (f.wait_for(20s) != std::future_status::ready) {
    ADD_FAILURE() << "p2p operation did not complete within 20 s";
    return Result{std::make_exception_ptr(Error("hung")), -2};
  }
  return f.get();
}

// Runs fn(group, engine) on n thread ranks, each with its own group and engine (4 KB rings).
void runEngines(int n, const std::function<void(shm::ShmGroup&, P2PEngine&)>& fn) {
  runGroup(n, smallOptions(), [&](shm::ShmGroup& g) {
    P2PEngine engine(g);
    fn(g, engine);
  });
}

std::vector<char> payload(size_t bytes, int src, int dst, uint64_t i) {
  return randomBytes(bytes, (i * 7 + src) * 7 + dst + 99);
}

TEST(P2P, SizesAroundAndAboveTheRing) {
  const std::vector<size_t> sizes = {0, 1, 15, 16, 17, 4079, 4080, 4095, 4096, 4097, 100 * 1024, 100 * 1024 + 3};
  runEngines(2, [&](shm::ShmGroup& g, P2PEngine& e) {
    std::vector<std::vector<char>> bufs;
    std::vector<std::future<Result>> ops;
    for (size_t i = 0; i < sizes.size(); ++i) {
      bufs.push_back(g.rank() == 0 ? payload(sizes[i], 0, 1, i) : std::vector<char>(sizes[i], 'x'));
    }
    for (size_t i = 0; i < sizes.size(); ++i) {  // all posted at once; tag = index
      ops.push_back(g.rank() == 0 ? sendAsync(e, bufs[i], 1, static_cast<int>(i))
                                  : recvAsync(e, bufs[i], 0, static_cast<int>(i)));
    }
    for (size_t i = 0; i < sizes.size(); ++i) {
      Result r = await(ops[i]);
      EXPECT_EQ(r.error(), "") << "size " << sizes[i];
      if (g.rank() == 1) {
        EXPECT_EQ(r.src, 0);
        EXPECT_TRUE(bufs[i] == payload(sizes[i], 0, 1, i)) << "size " << sizes[i];
      }
    }
  });
}

TEST(P2P, SymmetricExchangeOfLargeMessagesDoesNotDeadlock) {
  for (int n : {2, 3, 4}) {
    constexpr size_t kBytes = (1 << 20) + 5;  // 256 rings' worth
    runEngines(n, [&](shm::ShmGroup& g, P2PEngine& e) {
      const int me = g.rank();
      std::vector<std::vector<char>> out(n), in(n, std::vector<char>(kBytes));
      std::vector<std::future<Result>> sends, recvs;
      for (int p = 0; p < n; ++p) {  // every send is posted before any receive
        if (p == me) continue;
        out[p] = payload(kBytes, me, p, 0);
        sends.push_back(sendAsync(e, out[p], p, 0));
      }
      for (int p = 0; p < n; ++p) {
        if (p != me) recvs.push_back(recvAsync(e, in[p], p, 0));
      }
      for (auto& f : sends) EXPECT_EQ(await(f).error(), "");
      for (auto& f : recvs) EXPECT_EQ(await(f).error(), "");
      for (int p = 0; p < n; ++p) {
        if (p == me) continue;
        EXPECT_TRUE(in[p] == payload(kBytes, p, me, 0)) << "n=" << n << " " << p << "->" << me;
      }
    });
  }
}

TEST(P2P, ManyMessagesArriveInOrder) {
  constexpr int kCount = 2000;
  runEngines(2, [&](shm::ShmGroup& g, P2PEngine& e) {
    std::vector<std::vector<char>> bufs(kCount);
    std::vector<std::future<Result>> ops;
    for (int i = 0; i < kCount; ++i) {
      const size_t bytes = (i * 37) % 700;  // same tag for all: only the order tells them apart
      if (g.rank() == 0) {
        bufs[i] = payload(bytes, 0, 1, i);
        ops.push_back(sendAsync(e, bufs[i], 1, 5));
      } else {
        bufs[i].assign(bytes, 'x');
        ops.push_back(recvAsync(e, bufs[i], 0, 5));
        if (i % 100 == 99) {  // receives trail the sends
          EXPECT_EQ(await(ops[i]).error(), "");
        }
      }
    }
    for (int i = 0; i < kCount; ++i) {
      if (ops[i].valid()) {
        EXPECT_EQ(await(ops[i]).error(), "") << i;
      }
      if (g.rank() == 1) {
        EXPECT_TRUE(bufs[i] == payload(bufs[i].size(), 0, 1, i)) << "message " << i;
      }
    }
  });
}

// Rank 0 sends tag 1 then tag 2; rank 1 receives tag 2 first, so the tag-1 message must be
// moved out of the ring (stashed) and handed to the tag-1 receive later.
TEST(P2P, TagsReceivedOutOfPostingOrder) {
  for (size_t bytes : {size_t{10}, size_t{4096}, size_t{10000}}) {
    for (bool postBothFirst : {false, true}) {
      runEngines(2, [&](shm::ShmGroup& g, P2PEngine& e) {
        if (g.rank() == 0) {
          std::vector<char> a = payload(bytes, 0, 1, 1), b = payload(bytes + 1, 0, 1, 2);
          auto fa = sendAsync(e, a, 1, 1);
          auto fb = sendAsync(e, b, 1, 2);
          EXPECT_EQ(await(fa).error(), "");
          EXPECT_EQ(await(fb).error(), "");
          return;
        }
        std::vector<char> a(bytes), b(bytes + 1);
        auto fb = recvAsync(e, b, 0, 2);
        std::future<Result> fa;
        if (postBothFirst) fa = recvAsync(e, a, 0, 1);
        EXPECT_EQ(await(fb).error(), "");
        if (!postBothFirst) fa = recvAsync(e, a, 0, 1);
        EXPECT_EQ(await(fa).error(), "");
        EXPECT_TRUE(b == payload(bytes + 1, 0, 1, 2)) << bytes;
        EXPECT_TRUE(a == payload(bytes, 0, 1, 1)) << bytes;
      });
    }
  }
}

TEST(P2P, StashedMessagesOfOneTagKeepTheirOrder) {
  runEngines(2, [&](shm::ShmGroup& g, P2PEngine& e) {
    constexpr int kEach = 20;
    if (g.rank() == 0) {  // tag 1 x20, then tag 2 x20, interleaved sizes
      std::vector<std::vector<char>> bufs;
      std::vector<std::future<Result>> ops;
      for (int tag : {1, 2}) {
        for (int i = 0; i < kEach; ++i) bufs.push_back(payload(100 + 300 * i, tag, 1, i));
      }
      for (int k = 0; k < 2 * kEach; ++k) ops.push_back(sendAsync(e, bufs[k], 1, 1 + k / kEach));
      for (auto& f : ops) EXPECT_EQ(await(f).error(), "");
      return;
    }
    std::vector<std::vector<char>> got1(kEach), got2(kEach);
    std::vector<std::future<Result>> ops;
    for (int i = 0; i < kEach; ++i) {  // all tag-2 receives first
      got2[i].resize(100 + 300 * i);
      ops.push_back(recvAsync(e, got2[i], 0, 2));
    }
    for (auto& f : ops) EXPECT_EQ(await(f).error(), "");
    ops.clear();
    for (int i = 0; i < kEach; ++i) {
      got1[i].resize(100 + 300 * i);
      ops.push_back(recvAsync(e, got1[i], 0, 1));
    }
    for (auto& f : ops) EXPECT_EQ(await(f).error(), "");
    for (int i = 0; i < kEach; ++i) {
      EXPECT_TRUE(got1[i] == payload(100 + 300 * i, 1, 1, i)) << "tag 1 message " << i;
      EXPECT_TRUE(got2[i] == payload(100 + 300 * i, 2, 1, i)) << "tag 2 message " << i;
    }
  });
}

TEST(P2P, RecvFromAnySourceReportsTheSender) {
  for (size_t bytes : {size_t{64}, size_t{100 * 1024}}) {  // within one ring, and many rings' worth
    constexpr int n = 4, kRounds = 3;
    runEngines(n, [&](shm::ShmGroup& g, P2PEngine& e) {
      const int me = g.rank();
      if (me != 0) {
        for (int round = 0; round < kRounds; ++round) {
          std::vector<char> v = payload(bytes, me, 0, round);
          auto f = sendAsync(e, v, 0, 7);
          EXPECT_EQ(await(f).error(), "");
        }
        return;
      }
      std::vector<std::vector<char>> bufs((n - 1) * kRounds, std::vector<char>(bytes));
      std::vector<std::future<Result>> ops;
      for (auto& b : bufs) ops.push_back(recvAsync(e, b, -1, 7));
      std::vector<int> rounds(n, 0);
      for (size_t k = 0; k < bufs.size(); ++k) {
        Result r = await(ops[k]);
        EXPECT_EQ(r.error(), "");
        ASSERT_GE(r.src, 1);
        ASSERT_LT(r.src, n);
        // Messages from one source arrive in order.
        EXPECT_TRUE(bufs[k] == payload(bytes, r.src, 0, rounds[r.src]))
            << "bytes " << bytes << " receive " << k << " from " << r.src;
        ++rounds[r.src];
      }
      for (int p = 1; p < n; ++p) EXPECT_EQ(rounds[p], kRounds) << "source " << p;
    });
  }
}

// A receive of another size or dtype fails naming both sides, and breaks the pair's ring, so the
// sender's next send to that rank fails with the same description (its first had completed).
TEST(P2P, SizeOrDtypeMismatchFailsTheReceiveAndTheSendersNextSend) {
  struct Case {
    size_t recvBytes;
    int sentDtype, recvDtype;
    const char* sent;
    const char* received;
  };
  for (const Case& c : {Case{50, 6, 6, "100 bytes of dtype code 6", "50 bytes of dtype code 6"},
                        Case{100, 6, 3, "100 bytes of dtype code 6", "100 bytes of dtype code 3"}}) {
    std::promise<void> rejected;
    auto rejectedFuture = rejected.get_future().share();
    runEngines(2, [&](shm::ShmGroup& g, P2PEngine& e) {
      if (g.rank() == 0) {
        std::vector<char> v = payload(100, 0, 1, 0);
        auto f = sendAsync(e, v, 1, 3, ctxFor("send", 1), c.sentDtype);
        EXPECT_EQ(await(f).error(), "");
        rejectedFuture.wait();
        auto f2 = sendAsync(e, v, 1, 3, ctxFor("send", 2), c.sentDtype);
        const std::string err = await(f2).error();
        EXPECT_NE(err.find(c.sent), std::string::npos) << err;
        EXPECT_NE(err.find(c.received), std::string::npos) << err;
        EXPECT_NE(err.find("tag 3"), std::string::npos) << err;
        return;
      }
      std::vector<char> buf(c.recvBytes);
      auto f = recvAsync(e, buf, 0, 3, ctxFor("recv", 1), c.recvDtype);
      const std::string err = await(f).error();
      rejected.set_value();
      EXPECT_NE(err.find(c.sent), std::string::npos) << err;
      EXPECT_NE(err.find(c.received), std::string::npos) << err;
      EXPECT_NE(err.find("rank 0 sent"), std::string::npos) << err;
    });
  }
}

TEST(P2P, RecvWithoutSenderTimesOut) {
  std::promise<void> done;
  auto doneFuture = done.get_future().share();
  runEngines(2, [&](shm::ShmGroup& g, P2PEngine& e) {
    if (g.rank() == 0) {  // sends nothing, stays up until rank 1 has checked
      doneFuture.wait();
      return;
    }
    std::vector<char> v(10);
    const auto start = Clock::now();
    auto f = recvAsync(e, v, 0, 4, ctxFor("recv", 9, 200ms));
    Result r = await(f);
    const auto elapsed = Clock::now() - start;
    try {
      if (r.err) std::rethrow_exception(r.err);
      ADD_FAILURE() << "recv without a sender succeeded";
    } catch (const TimeoutError& ex) {
      const std::string msg = ex.what();
      EXPECT_NE(msg.find("recv (sequence 9, tag 4)"), std::string::npos) << msg;
      EXPECT_NE(msg.find("rank 0 did not send"), std::string::npos) << msg;
    } catch (const std::exception& ex) {
      ADD_FAILURE() << "expected TimeoutError, got: " << ex.what();
    }
    EXPECT_GE(elapsed, 190ms);
    EXPECT_LT(elapsed, 2s);
    auto any = recvAsync(e, v, -1, 4, ctxFor("recv", 10, 100ms));
    EXPECT_NE(await(any).error().find("no rank sent"), std::string::npos);
    done.set_value();
  });
}

TEST(P2P, SendWithoutReceiverTimesOut) {
  std::promise<void> done;
  auto doneFuture = done.get_future().share();
  runEngines(2, [&](shm::ShmGroup& g, P2PEngine& e) {
    if (g.rank() == 1) {
      doneFuture.wait();
      return;
    }
    std::vector<char> v(20000);  // larger than the ring: cannot complete without a receiver
    auto f = sendAsync(e, v, 1, 2, ctxFor("send", 3, 200ms));
    const std::string err = await(f).error();
    EXPECT_NE(err.find("send (sequence 3, tag 2)"), std::string::npos) << err;
    EXPECT_NE(err.find("rank 1 did not receive"), std::string::npos) << err;
    done.set_value();
  });
}

TEST(P2P, ShutdownFailsPendingOperationsAndRejectsNewOnes) {
  runEngines(2, [&](shm::ShmGroup& g, P2PEngine& e) {
    if (g.rank() == 1) return;
    std::vector<char> v(10);
    auto f = recvAsync(e, v, 1, 0, ctxFor("recv", 1, 30s));
    std::this_thread::sleep_for(50ms);
    const auto start = Clock::now();
    e.shutdown();
    Result r = await(f);
    EXPECT_LT(Clock::now() - start, 1s);
    ASSERT_TRUE(r.err);
    EXPECT_THROW(std::rethrow_exception(r.err), AbortedError);
    EXPECT_THROW(e.send(v.data(), v.size(), 1, 0, ctxFor("send", 2), nullptr), Error);
    e.shutdown();  // idempotent
  });
}

// The engine thread and collectives on the rank's own thread share one group: p2p uses the rings
// and doorbells, collectives the step counters and buffer halves.
TEST(P2P, RunsAlongsideCollectivesOnTheSameGroup) {
  constexpr int n = 3;
  runEngines(n, [&](shm::ShmGroup& g, P2PEngine& e) {
    const int me = g.rank(), next = (me + 1) % n, prev = (me + n - 1) % n;
    std::vector<char> out = payload(50000, me, next, 0), in(50000);
    auto fs = sendAsync(e, out, next, 0);
    auto fr = recvAsync(e, in, prev, 0);
    for (uint64_t i = 1; i <= 20; ++i) {
      std::vector<int32_t> v(3001, me + 1), sum(3001);
      AllreduceOptions o;
      o.in = SpanList(v.data(), v.size() * 4);
      o.out = SpanList(sum.data(), sum.size() * 4);
      o.dtype = DataType::kInt32;
      allreduce(g, o, ctxFor("allreduce", i));
      EXPECT_EQ(sum.front(), n * (n + 1) / 2);
      EXPECT_EQ(sum.back(), n * (n + 1) / 2);
    }
    EXPECT_EQ(await(fs).error(), "");
    EXPECT_EQ(await(fr).error(), "");
    EXPECT_TRUE(in == payload(50000, prev, me, 0));
  });
}

TEST(P2P, InvalidPeersAreRejected) {
  runEngines(3, [&](shm::ShmGroup& g, P2PEngine& e) {
    std::vector<char> v(4);
    const int me = g.rank();
    EXPECT_THROW(e.send(v.data(), 4, me, 0, ctxFor("send", 1), nullptr), Error);
    EXPECT_THROW(e.send(v.data(), 4, 3, 0, ctxFor("send", 1), nullptr), Error);
    EXPECT_THROW(e.send(v.data(), 4, -1, 0, ctxFor("send", 1), nullptr), Error);
    EXPECT_THROW(e.recv(v.data(), 4, me, 0, ctxFor("recv", 1), nullptr), Error);
    EXPECT_THROW(e.recv(v.data(), 4, -2, 0, ctxFor("recv", 1), nullptr), Error);
  });
}

}  // namespace
}  // namespace tdx::test
