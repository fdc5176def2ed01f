// Mismatched collectives (op_desc): ranks that call different collectives, or the same one with
// different dtype / size / root / reduce op, get a tdx::Error saying "mismatched" instead of
// corrupting memory. Only cases the descriptors detect are tested; every wait has a 2 s deadline.
#include "collectives/op_desc.h"

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "collectives/collectives.h"
#include "thread_ranks.h"

namespace tdx::test {
namespace {

using namespace std::chrono_literals;
using RankFn = std::function<void(shm::ShmGroup&, const WaitContext&)>;

// What each rank saw: its error message, or empty when its call returned.
std::vector<std::string> runMismatch(const RankFn& rank0, const RankFn& rank1) {
  std::vector<std::string> errors(2);
  runGroup(2, smallOptions(), [&](shm::ShmGroup& g) {
    try {
      (g.rank() == 0 ? rank0 : rank1)(g, ctxFor("collective", 1, 2s));
    } catch (const TimeoutError& e) {
      errors[g.rank()] = std::string("TIMEOUT: ") + e.what();
    } catch (const Error& e) {
      errors[g.rank()] = e.what();
    }
  });
  return errors;
}

bool mentionsMismatch(const std::string& msg) {
  return msg.find("mismatched") != std::string::npos && msg.find("TIMEOUT") == std::string::npos;
}

RankFn allreduceOf(size_t count, DataType dt = DataType::kFloat32, ReduceOp op = ReduceOp::kSum, int root = -1,
                   AllreduceAlgorithm algo = AllreduceAlgorithm::kAuto) {
  return [=](shm::ShmGroup& g, const WaitContext& ctx) {
    std::vector<char> buf(count * elementSize(dt));
    AllreduceOptions o;
    o.in = o.out = SpanList(buf.data(), buf.size());
    o.dtype = dt;
    o.op = op;
    o.root = root;
    o.algorithm = algo;
    allreduce(g, o, ctx);
  };
}

RankFn barrierCall() {
  return [](shm::ShmGroup& g, const WaitContext& ctx) { barrier(g, ctx); };
}

TEST(Mismatch, AllreduceWithDifferentSizes) {
  for (auto algo : {AllreduceAlgorithm::kOneShot, AllreduceAlgorithm::kReduceScatterAllgather,
                    AllreduceAlgorithm::kAuto}) {
    // Auto picks different algorithms on the two ranks here (one-shot up to 64 KB).
    const size_t big = algo == AllreduceAlgorithm::kAuto ? 30000 : 200;
    auto errors = runMismatch(allreduceOf(100, DataType::kFloat32, ReduceOp::kSum, -1, algo),
                              allreduceOf(big, DataType::kFloat32, ReduceOp::kSum, -1, algo));
    for (int r = 0; r < 2; ++r) {
      EXPECT_TRUE(mentionsMismatch(errors[r])) << "rank " << r << ": " << errors[r];
      EXPECT_NE(errors[r].find("400 bytes"), std::string::npos) << errors[r];
      EXPECT_NE(errors[r].find("sequence 1"), std::string::npos) << errors[r];
    }
  }
}

TEST(Mismatch, AllreduceVersusBarrier) {
  auto errors = runMismatch(allreduceOf(64), barrierCall());
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(mentionsMismatch(errors[r])) << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("allreduce"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("barrier"), std::string::npos) << errors[r];
  }
}

TEST(Mismatch, AllreduceWithDifferentDtypes) {
  auto errors = runMismatch(allreduceOf(64, DataType::kFloat32), allreduceOf(64, DataType::kInt32));
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(mentionsMismatch(errors[r])) << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("float32"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("int32"), std::string::npos) << errors[r];
  }
}

TEST(Mismatch, AllreduceWithDifferentReduceOps) {
  auto errors = runMismatch(allreduceOf(64, DataType::kFloat32, ReduceOp::kSum),
                            allreduceOf(64, DataType::kFloat32, ReduceOp::kMax));
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(mentionsMismatch(errors[r])) << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("MAX"), std::string::npos) << errors[r];
  }
}

TEST(Mismatch, ReduceWithDifferentRoots) {
  // Each rank believes it is the root: both wait for and check the other's descriptor.
  auto errors = runMismatch(allreduceOf(64, DataType::kFloat32, ReduceOp::kSum, 0),
                            allreduceOf(64, DataType::kFloat32, ReduceOp::kSum, 1));
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(mentionsMismatch(errors[r])) << "rank " << r << ": " << errors[r];
}

TEST(Mismatch, AllreduceVersusReduceScatter) {
  RankFn rs = [](shm::ShmGroup& g, const WaitContext& ctx) {
    std::vector<float> in(2 * 16), out(16);
    ReduceScatterOptions o;
    o.in = {Span{reinterpret_cast<char*>(in.data()), 64}, Span{reinterpret_cast<char*>(in.data() + 16), 64}};
    o.out = Span{reinterpret_cast<char*>(out.data()), 64};
    reduceScatter(g, o, ctx);
  };
  auto errors = runMismatch(allreduceOf(16), rs);
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(mentionsMismatch(errors[r])) << "rank " << r << ": " << errors[r];
}

TEST(Mismatch, BroadcastWithDifferentSizesIsCaughtByEveryRank) {
  RankFn bcast100 = [](shm::ShmGroup& g, const WaitContext& ctx) {
    std::vector<char> v(100);
    broadcast(g, BroadcastOptions{SpanList(v.data(), v.size()), 0}, ctx);
  };
  RankFn bcast200 = [](shm::ShmGroup& g, const WaitContext& ctx) {
    std::vector<char> v(200);
    broadcast(g, BroadcastOptions{SpanList(v.data(), v.size()), 0}, ctx);
  };
  auto errors = runMismatch(bcast100, bcast200);
  for (int r = 0; r < 2; ++r) {  // the root compares the others' descriptors too
    EXPECT_TRUE(mentionsMismatch(errors[r])) << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("100 bytes"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("200 bytes"), std::string::npos) << errors[r];
  }
}

TEST(Mismatch, AllgatherWithWrongOutputSize) {
  auto gatherFn = [](size_t mine, size_t peer) {
    return [=](shm::ShmGroup& g, const WaitContext& ctx) {
      std::vector<char> in(mine), out0(g.rank() == 0 ? mine : peer), out1(g.rank() == 1 ? mine : peer);
      AllgatherOptions o;
      o.in = Span{in.data(), in.size()};
      o.out = {Span{out0.data(), out0.size()}, Span{out1.data(), out1.size()}};
      allgather(g, o, ctx);
    };
  };
  // Rank 0 expects 100 bytes from rank 1, which sends 300: the message names the output slot.
  auto errors = runMismatch(gatherFn(100, 100), gatherFn(300, 100));
  EXPECT_NE(errors[0].find("output tensor for rank 1 has 100 bytes but that rank's input has 300 bytes"),
            std::string::npos)
      << errors[0];
}

TEST(Mismatch, GatherVersusAllgather) {
  // A gather's non-root checks the root's descriptor too.
  auto fn = [](int root) {
    return [=](shm::ShmGroup& g, const WaitContext& ctx) {
      std::vector<char> in(10), out0(10), out1(10);
      AllgatherOptions o;
      o.in = Span{in.data(), in.size()};
      if (root < 0 || root == g.rank()) o.out = {Span{out0.data(), 10}, Span{out1.data(), 10}};
      o.root = root;
      allgather(g, o, ctx);
    };
  };
  auto errors = runMismatch(fn(-1), fn(0));
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(mentionsMismatch(errors[r])) << "rank " << r << ": " << errors[r];
}

TEST(Mismatch, AlltoallVersusAllreduce) {
  RankFn a2a = [](shm::ShmGroup& g, const WaitContext& ctx) {
    std::vector<char> buf(4 * 64);
    AlltoallOptions o;
    o.in = {Span{buf.data(), 64}, Span{buf.data() + 64, 64}};
    o.out = {Span{buf.data() + 128, 64}, Span{buf.data() + 192, 64}};
    alltoall(g, o, ctx);
  };
  auto errors = runMismatch(a2a, allreduceOf(16));
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(mentionsMismatch(errors[r])) << "rank " << r << ": " << errors[r];
}

TEST(Mismatch, TwoBroadcastRootsAreCaughtInTheBroadcastOnBothRanks) {
  // Both ranks believe they are the root; every rank of a rooted collective compares every rank's
  // descriptor in its first round, so the broadcast itself raises on both.
  auto bcast = [](int root) {
    return [=](shm::ShmGroup& g, const WaitContext& ctx) {
      std::vector<char> v(64);
      broadcast(g, BroadcastOptions{SpanList(v.data(), v.size()), root}, ctx);
    };
  };
  auto errors = runMismatch(bcast(0), bcast(1));
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(mentionsMismatch(errors[r])) << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("broadcast(sequence 1, dtype bytes, 64 bytes, root 0)"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("broadcast(sequence 1, dtype bytes, 64 bytes, root 1)"), std::string::npos) << errors[r];
  }
}

TEST(Mismatch, MatchingRootedCollectivesKeepHistoriesEqual) {
  auto fn = [](shm::ShmGroup& g, const WaitContext& ctx) {
    std::vector<char> v(64);
    WaitContext c = ctx;
    for (int i = 0; i < 5; ++i) {
      c.seq = ctx.seq + i;
      broadcast(g, BroadcastOptions{SpanList(v.data(), v.size()), i % 2}, c);
    }
    c.seq += 1;
    barrier(g, c);
  };
  auto errors = runMismatch(fn, fn);
  EXPECT_TRUE(errors[0].empty()) << errors[0];
  EXPECT_TRUE(errors[1].empty()) << errors[1];
}

TEST(Mismatch, GroupStaysUsableAfterMatchingCalls) {
  // The happy path through the same helpers: no error at all.
  auto errors = runMismatch(allreduceOf(64), allreduceOf(64));
  EXPECT_TRUE(errors[0].empty()) << errors[0];
  EXPECT_TRUE(errors[1].empty()) << errors[1];
}

}  // namespace
}  // namespace tdx::test
