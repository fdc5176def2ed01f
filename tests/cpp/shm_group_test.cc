// ShmGroup: step counters (post / waitAll / waitRank), timeouts, abort, segment lifetime.
#include "transport/shm/shm_group.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <chrono>
#include <thread>

#include "common/env.h"
#include "thread_ranks.h"

namespace tdx::test {
namespace {

using namespace std::chrono_literals;
using shm::ShmGroup;
using Clock = std::chrono::steady_clock;

class ShmGroupSizes : public ::testing::TestWithParam<int> {};

TEST_P(ShmGroupSizes, PostWaitAllIsABarrier) {
  const int n = GetParam();
  constexpr int kSteps = 200;
  std::vector<std::atomic<int>> phase(n);
  for (auto& p : phase) p = 0;
  runGroup(n, smallOptions(), [&](ShmGroup& g) {
    EXPECT_EQ(g.size(), n);
    EXPECT_EQ(g.posted(), 0u);
    auto ctx = ctxFor("barrier_test", 1);
    for (int s = 1; s <= kSteps; ++s) {
      phase[g.rank()].store(s);
      const uint32_t step = g.post();
      ASSERT_EQ(step, static_cast<uint32_t>(s));
      g.waitAll(step, ctx);
      for (int r = 0; r < n; ++r) ASSERT_GE(phase[r].load(), s) << "rank " << r << " behind at step " << s;
    }
    EXPECT_EQ(g.posted(), static_cast<uint32_t>(kSteps));
  });
}

TEST_P(ShmGroupSizes, WaitRankFollowsOneRank) {
  const int n = GetParam();
  std::atomic<int> rootPhase{0};
  runGroup(n, smallOptions(), [&](ShmGroup& g) {
    auto ctx = ctxFor("wait_rank_test", 2);
    for (int s = 1; s <= 100; ++s) {
      if (g.rank() == 0) rootPhase.store(s);
      const uint32_t step = g.post();
      g.waitRank(0, step, ctx);
      ASSERT_GE(rootPhase.load(), s);
    }
    g.waitAll(g.posted(), ctx);  // nobody leaves while others still wait on rank 0
  });
}

TEST_P(ShmGroupSizes, BufferHalvesAreDistinctAndShared) {
  const int n = GetParam();
  runGroup(n, smallOptions(), [&](ShmGroup& g) {
    EXPECT_EQ(g.halfBytes(), 4096u);
    EXPECT_EQ(g.ringBytes(), 4096u);
    // Every rank writes its rank into both of its halves; every peer reads them.
    std::memset(g.half(g.rank(), 0), 'a' + g.rank(), g.halfBytes());
    std::memset(g.half(g.rank(), 1), 'A' + g.rank(), g.halfBytes());
    auto ctx = ctxFor("halves_test", 3);
    g.waitAll(g.post(), ctx);
    for (int r = 0; r < n; ++r) {
      for (size_t i : {size_t{0}, g.halfBytes() / 2, g.halfBytes() - 1}) {
        ASSERT_EQ(g.half(r, 0)[i], 'a' + r);
        ASSERT_EQ(g.half(r, 1)[i], 'A' + r);
      }
    }
    g.waitAll(g.post(), ctx);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShmGroupSizes, ::testing::Values(1, 2, 3, 4));

TEST(ShmGroup, TimeoutNamesOpSequenceAndMissingRank) {
  constexpr int n = 3;
  std::atomic<bool> done{false};
  InMemoryRendezvous rdv;
  spawnThreads(n, [&](int rank) {
    GroupInfo info = groupInfo(rank, n, "tgroup");
    info.globalRanks = {4, 5, 6};
    ShmGroup g(info, rdv, smallOptions());
    if (rank == 2) {  // never posts; stays alive until rank 0 has seen the timeout
      while (!done.load()) std::this_thread::sleep_for(1ms);
      return;
    }
    g.post();
    if (rank == 1) return;
    auto ctx = ctxFor("allreduce", 17, 300ms);
    const auto start = Clock::now();
    try {
      g.waitAll(1, ctx);
      ADD_FAILURE() << "waitAll returned although rank 2 never posted";
    } catch (const TimeoutError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("allreduce"), std::string::npos) << msg;
      EXPECT_NE(msg.find("sequence 17"), std::string::npos) << msg;
      EXPECT_NE(msg.find("ranks [2 (global rank 6)]"), std::string::npos) << msg;
      EXPECT_NE(msg.find("tgroup"), std::string::npos) << msg;
      EXPECT_NE(msg.find("300 ms"), std::string::npos) << msg;
    }
    const auto elapsed = Clock::now() - start;
    EXPECT_GE(elapsed, 290ms);
    EXPECT_LT(elapsed, 3s);
    // waitRank names only the rank waited for.
    try {
      g.waitRank(2, 1, ctxFor("broadcast", 18, 50ms));
      ADD_FAILURE() << "waitRank returned although rank 2 never posted";
    } catch (const TimeoutError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("broadcast (sequence 18)"), std::string::npos) << msg;
      EXPECT_NE(msg.find("ranks [2 (global rank 6)]"), std::string::npos) << msg;
    }
    done.store(true);
  });
}

TEST(ShmGroup, AbortWakesAWaiterPromptly) {
  constexpr int n = 2;
  std::atomic<bool> done{false};
  InMemoryRendezvous rdv;
  spawnThreads(n, [&](int rank) {
    ShmGroup g(groupInfo(rank, n), rdv, smallOptions());
    if (rank == 1) {  // never posts
      while (!done.load()) std::this_thread::sleep_for(1ms);
      return;
    }
    g.post();
    std::exception_ptr caught;
    Clock::time_point thrownAt;
    std::thread waiter([&] {
      try {
        g.waitAll(1, ctxFor("allgather", 5, 30s));
      } catch (...) {
        caught = std::current_exception();
      }
      thrownAt = Clock::now();
    });
    std::this_thread::sleep_for(150ms);  // long enough for the waiter to be asleep on the futex
    const auto abortedAt = Clock::now();
    g.abort();
    waiter.join();
    done.store(true);
    ASSERT_TRUE(caught);
    try {
      std::rethrow_exception(caught);
    } catch (const AbortedError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("allgather (sequence 5)"), std::string::npos) << msg;
      EXPECT_NE(msg.find("aborted"), std::string::npos) << msg;
      EXPECT_NE(msg.find("[1]"), std::string::npos) << msg;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "expected AbortedError, got: " << e.what();
    }
    EXPECT_LT(thrownAt - abortedAt, 500ms);
    EXPECT_TRUE(g.aborted());
    // Later waits fail at once too.
    EXPECT_THROW(g.waitAll(1, ctxFor("barrier", 6, 30s)), AbortedError);
  });
}

TEST(ShmGroup, AFailedPeerIsReportedPromptlyAndTheGroupRefusesMoreCollectives) {
  constexpr int n = 3;
  std::atomic<bool> done{false};
  InMemoryRendezvous rdv;
  spawnThreads(n, [&](int rank) {
    ShmGroup g(groupInfo(rank, n), rdv, smallOptions());
    if (rank == 2) {  // fails its collective without posting, then stays alive
      std::this_thread::sleep_for(100ms);
      g.markFailed(ctxFor("allreduce", 4), "tdx: injected failure on rank 2");
      EXPECT_THROW(g.acquireHalf(ctxFor("allreduce", 5)), Error);
      while (!done.load()) std::this_thread::sleep_for(1ms);
      return;
    }
    g.post();
    const auto start = Clock::now();
    try {
      g.waitAll(1, ctxFor("allreduce", 4, 30s));
      ADD_FAILURE() << "wait for a failed peer returned";
    } catch (const PeerFailedError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("allreduce (sequence 4)"), std::string::npos) << msg;
      EXPECT_NE(msg.find("injected failure on rank 2"), std::string::npos) << msg;
      EXPECT_NE(msg.find("[2]"), std::string::npos) << msg;
    }
    EXPECT_LT(Clock::now() - start, 5s);
    try {
      g.acquireHalf(ctxFor("broadcast", 5, 30s));
      ADD_FAILURE() << "a collective after a failed one was not refused";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("an earlier collective failed"), std::string::npos) << e.what();
    }
    if (rank == 0) {
      std::this_thread::sleep_for(50ms);
      done.store(true);
    }
  });
}

TEST(ShmGroup, ARefusalFailsTheWaitsOfThatCollective) {
  constexpr int n = 3;
  std::atomic<int> raised{0};
  InMemoryRendezvous rdv;
  spawnThreads(n, [&](int rank) {
    ShmGroup g(groupInfo(rank, n), rdv, smallOptions());
    if (rank == 2) {  // refuses collective 4 before taking a step of it, then stays alive
      std::this_thread::sleep_for(100ms);
      g.postRefusal(ctxFor("all_gather", 4), "tdx: all_gather: output list has 2 tensors");
      while (raised.load() < 2) std::this_thread::sleep_for(1ms);
      return;
    }
    const auto start = Clock::now();
    try {
      g.waitAll(g.post(), ctxFor("all_gather", 4, 30s));
      ADD_FAILURE() << "a wait for a rank that refused the collective returned";
    } catch (const PeerFailedError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("all_gather (sequence 4)"), std::string::npos) << msg;
      EXPECT_NE(msg.find("rank 2 refused the call: tdx: all_gather: output list has 2 tensors"), std::string::npos)
          << msg;
    }
    EXPECT_LT(Clock::now() - start, 5s);
    EXPECT_EQ(g.peerRefusal(2, 5), "");  // the note is for collective 4 only
    raised.fetch_add(1);
  });
}

TEST(ShmGroup, ARefusalEveryRankMadeLeavesTheGroupUsable) {
  constexpr int n = 3;
  InMemoryRendezvous rdv;
  spawnThreads(n, [&](int rank) {
    ShmGroup g(groupInfo(rank, n), rdv, smallOptions());
    g.postRefusal(ctxFor("all_gather", 4), "tdx: all_gather: refused everywhere");
    g.waitAll(g.post(), ctxFor("barrier", 5, 30s));  // would throw if collective 4's note counted
    EXPECT_NE(g.peerRefusal((rank + 1) % n, 4).find("refused everywhere"), std::string::npos);
    EXPECT_EQ(g.peerRefusal((rank + 1) % n, 5), "");
  });
}

TEST(ShmGroup, SegmentsAreUnlinkedOnceMappedAndNothingRemains) {
  ASSERT_TRUE(ownShmEntries().empty());
  for (int n = 1; n <= 4; ++n) {
    InMemoryRendezvous rdv;
    spawnThreads(n, [&](int rank) {
      ShmGroup g(groupInfo(rank, n), rdv, smallOptions());
      g.waitAll(g.post(), ctxFor("check", 1));
      // Every rank has mapped every segment by now, so every name is gone already.
      EXPECT_TRUE(ownShmEntries().empty()) << "n=" << n;
      g.waitAll(g.post(), ctxFor("check", 2));
    });
    EXPECT_TRUE(ownShmEntries().empty()) << "n=" << n;
  }
}

TEST(ShmGroup, FailedSetupLeavesNoSegment) {
  // Rank 1 never arrives: rank 0's constructor fails in the rendezvous and must unlink its segment.
  InMemoryRendezvous rdv(200ms);
  EXPECT_THROW(ShmGroup(groupInfo(0, 2), rdv, smallOptions()), Error);
  EXPECT_TRUE(ownShmEntries().empty());
}

TEST(ShmGroup, DifferentBufferSizesAreRejectedClearly) {
  InMemoryRendezvous rdv(2s);
  std::vector<std::string> errors(2);
  spawnThreads(2, [&](int rank) {
    shm::ShmOptions o = smallOptions();
    if (rank == 1) o.halfBytes = 8192;
    try {
      ShmGroup g(groupInfo(rank, 2), rdv, o);
      ADD_FAILURE() << "rank " << rank << " built a group with mismatched buffer sizes";
    } catch (const Error& e) {
      errors[rank] = e.what();
    }
  });
  EXPECT_FALSE(errors[0].empty());
  EXPECT_FALSE(errors[1].empty());
  // Whichever rank opened its peer's segment first saw the size difference.
  const bool named = errors[0].find("TDX_BUFFER_BYTES") != std::string::npos ||
                     errors[1].find("TDX_BUFFER_BYTES") != std::string::npos;
  EXPECT_TRUE(named) << errors[0] << "\n" << errors[1];
  EXPECT_TRUE(ownShmEntries().empty());
}

TEST(ShmGroup, InvalidArgumentsAreUserErrors) {
  InMemoryRendezvous rdv(100ms);
  EXPECT_THROW(ShmGroup(groupInfo(2, 2), rdv, smallOptions()), Error);
  shm::ShmOptions tiny = smallOptions();
  tiny.halfBytes = 1024;
  EXPECT_THROW(ShmGroup(groupInfo(0, 1), rdv, tiny), Error);
  shm::ShmOptions odd = smallOptions();
  odd.ringBytes = 4096 + 8;
  EXPECT_THROW(ShmGroup(groupInfo(0, 1), rdv, odd), Error);
  EXPECT_TRUE(ownShmEntries().empty());
}

// The single-copy all_gather's default: on in groups of up to 4 ranks (from 16 KiB, 64 KiB on AMD
// CPUs), off above, where 7+ peers reading each rank's memory at once lost to shared memory.
TEST(ShmGroup, SingleCopyDefaultIsOffAboveFourRanks) {
  if (std::getenv("TDX_SINGLE_COPY_BYTES")) GTEST_SKIP() << "TDX_SINGLE_COPY_BYTES is set";
  const size_t on = cpuIsAmd() ? size_t{64} << 10 : size_t{16} << 10;
  for (int n : {2, 4, 5, 8}) {
    std::vector<size_t> seen(n);
    runGroup(n, smallOptions(), [&](ShmGroup& g) { seen[g.rank()] = g.singleCopyBytes(); });
    for (int r = 0; r < n; ++r) EXPECT_EQ(seen[r], n <= 4 ? on : 0u) << n << " ranks, rank " << r;
  }
  shm::ShmOptions asked = smallOptions();
  asked.singleCopyBytes = 64;  // an explicit offer holds at any size
  std::vector<size_t> seen(8);
  runGroup(8, asked, [&](ShmGroup& g) { seen[g.rank()] = g.singleCopyBytes(); });
  for (size_t b : seen) EXPECT_EQ(b, 64u);
}

// A rank that armed the stuck-rank watch and then shows no progress is excluded by the peer waiting
// on it (that peer's wait fails naming why, long before the timeout), and when it runs again its next
// operation is refused saying it was excluded. A silent rank that never armed the watch is waited for.
TEST(ShmGroup, AStuckRankThatArmedTheWatchIsExcludedAndRefusedWhenItRunsAgain) {
  std::string waiterError, stuckError;
  runGroup(2, smallOptions(), [&](ShmGroup& g) {
    auto ctx = ctxFor("stuck_test", 1, 20s);
    if (g.rank() == 1) {
      g.setStuckTimeout(200ms);
      g.noteProgress();
      std::this_thread::sleep_for(800ms);  // a hang in user code
      try {
        g.acquireHalf(ctx);
      } catch (const ExcludedError& e) {
        stuckError = e.what();
      }
      return;
    }
    try {
      g.waitAll(g.post(), ctx);
    } catch (const PeerFailedError& e) {
      waiterError = e.what();
    }
  });
  EXPECT_NE(waiterError.find("rank 1 (pid"), std::string::npos) << waiterError;
  EXPECT_NE(waiterError.find("was excluded from the group after making no progress for"), std::string::npos)
      << waiterError;
  EXPECT_NE(stuckError.find("refused on rank 1: rank 1 (pid"), std::string::npos) << stuckError;
  EXPECT_NE(stuckError.find("must exit"), std::string::npos) << stuckError;
  EXPECT_TRUE(ownShmEntries().empty());
}

TEST(ShmGroup, ASilentRankThatDidNotArmTheWatchIsWaitedFor) {
  runGroup(2, smallOptions(), [&](ShmGroup& g) {
    auto ctx = ctxFor("unarmed_test", 1, 20s);
    if (g.rank() == 1) std::this_thread::sleep_for(500ms);
    g.waitAll(g.post(), ctx);
    EXPECT_EQ(g.excludedWhy(1 - g.rank()), "");
  });
}

}  // namespace
}  // namespace tdx::test
