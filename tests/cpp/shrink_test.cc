// Shrinking a shared-memory group in place (transport/shm/shrink.h), ranks as threads: the
// survivors form a smaller group through the parent's segments (no rendezvous object), renumbered
// in order, and it runs collectives; survivors that disagree on who survives fail at the timeout
// naming the ranks they waited for; nothing is left in /dev/shm.
#include "transport/shm/shrink.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "collectives/collectives.h"
#include "thread_ranks.h"

namespace tdx {
namespace {

using test::ctxFor;
using test::groupInfo;
using test::InMemoryRendezvous;
using test::spawnThreads;

// Every rank's group of `n` ranks named "parent", with global ranks 10, 11, ... (to see them kept).
std::unique_ptr<shm::ShmGroup> makeParent(InMemoryRendezvous& rdv, int rank, int n) {
  GroupInfo info = groupInfo(rank, n, "parent");
  for (int r = 0; r < n; ++r) info.globalRanks.push_back(10 + r);
  return std::make_unique<shm::ShmGroup>(info, rdv, test::smallOptions());
}

// all_reduce (sum) of `value + i` over `count` floats: every rank must get the exact sum.
void expectAllreduce(shm::ShmGroup& g, const std::vector<float>& contributions, uint64_t seq) {
  const size_t count = 5000;  // several rounds of the 4 KiB buffer halves
  std::vector<float> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = contributions[g.rank()] + static_cast<float>(i % 7);
  AllreduceOptions o;
  o.in = SpanList(reinterpret_cast<char*>(v.data()), count * sizeof(float));
  o.out = o.in;
  allreduce(g, o, ctxFor("all_reduce", seq));
  float total = 0;
  for (float c : contributions) total += c;
  for (size_t i = 0; i < count; ++i) {
    ASSERT_EQ(v[i], total + static_cast<float>(g.size()) * static_cast<float>(i % 7)) << "element " << i;
  }
}

TEST(Shrink, SurvivorsFormASmallerGroupRenumberedInOrderAndReduceOverIt) {
  InMemoryRendezvous rdv;
  std::atomic<int> done{0};
  spawnThreads(4, [&](int rank) {
    auto parent = makeParent(rdv, rank, 4);
    if (rank == 1) {  // excluded: stays mapped (as a live excluded rank would) but takes no part
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (done.load() < 3 && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      return;
    }
    auto group = shm::shrinkGroup(*parent, {1}, groupInfo(0, 0, "child"), ctxFor("shrink", 0));
    const int expected = rank == 0 ? 0 : rank - 1;
    EXPECT_EQ(group->rank(), expected);
    EXPECT_EQ(group->size(), 3);
    EXPECT_EQ(group->info().name, "child");
    EXPECT_EQ(group->info().globalRanks, (std::vector<int64_t>{10, 12, 13}));
    ++done;  // before the checks below can fail: the excluded rank waits for it
    expectAllreduce(*group, {1.0f, 20.0f, 300.0f}, 1);
  });
  EXPECT_TRUE(test::ownShmEntries().empty());
}

TEST(Shrink, AShrunkGroupShrinksAgainAndNothingIsLeftInDevShm) {
  InMemoryRendezvous rdv;
  spawnThreads(4, [&](int rank) {
    auto parent = makeParent(rdv, rank, 4);
    if (rank == 3) return;
    auto child = shm::shrinkGroup(*parent, {3}, groupInfo(0, 0, "child"), ctxFor("shrink", 0));
    expectAllreduce(*child, {1.0f, 2.0f, 4.0f}, 1);
    if (child->rank() == 0) return;  // old rank 0 leaves the child too
    auto grandchild = shm::shrinkGroup(*child, {0}, groupInfo(0, 0, "grandchild"), ctxFor("shrink", 2));
    EXPECT_EQ(grandchild->rank(), rank - 1);
    EXPECT_EQ(grandchild->info().globalRanks, (std::vector<int64_t>{11, 12}));
    expectAllreduce(*grandchild, {8.0f, 16.0f}, 3);
  });
  EXPECT_TRUE(test::ownShmEntries().empty());
}

TEST(Shrink, SurvivorsThatDisagreeOnWhoSurvivesFailAtTheTimeoutNamingWhomTheyWaitedFor) {
  InMemoryRendezvous rdv;
  std::vector<std::string> errors(3);
  spawnThreads(3, [&](int rank) {
    auto parent = makeParent(rdv, rank, 3);
    // Ranks 1 and 2 exclude rank 0 and agree; rank 0 excludes rank 2 and waits for rank 1 alone.
    const std::vector<int> exclude = rank == 0 ? std::vector<int>{2} : std::vector<int>{0};
    try {
      auto group = shm::shrinkGroup(*parent, exclude, groupInfo(0, 0, "child"),
                                    ctxFor("shrink", 0, std::chrono::milliseconds(rank == 0 ? 300 : 20000)));
      expectAllreduce(*group, {5.0f, 7.0f}, 1);
    } catch (const Error& e) {
      errors[rank] = e.what();
    }
  });
  EXPECT_NE(errors[0].find("timed out"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("survivors"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("same ranks to exclude"), std::string::npos) << errors[0];
  EXPECT_EQ(errors[1], "");
  EXPECT_EQ(errors[2], "");
  EXPECT_TRUE(test::ownShmEntries().empty());
}

TEST(Shrink, AnExcludedRankCannotTakePart) {
  InMemoryRendezvous rdv;
  spawnThreads(2, [&](int rank) {
    auto parent = makeParent(rdv, rank, 2);
    if (rank == 1) {
      EXPECT_THROW(shm::shrinkGroup(*parent, {1}, groupInfo(0, 0, "child"), ctxFor("shrink", 0)), Error);
    }
  });
}

}  // namespace
}  // namespace tdx
