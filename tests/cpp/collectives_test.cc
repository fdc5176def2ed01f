// broadcast, allgather / gather, scatter, reduce_scatter, alltoall and barrier for 1..4 thread
// ranks, with 4 KB buffer halves so messages of a few tens of KB take many rounds.
#include "collectives/collectives.h"

#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <vector>

#include "reduce_reference.h"
#include "thread_ranks.h"

namespace tdx::test {
namespace {

// Deterministic content of the block rank `src` sends to rank `dst` in test step `t`.
std::vector<char> block(size_t bytes, int src, int dst, uint64_t t) {
  return randomBytes(bytes, (t * 131 + src) * 131 + dst + 1);
}

bool equal(const char* p, const std::vector<char>& want) {
  return want.empty() || std::memcmp(p, want.data(), want.size()) == 0;
}

// Byte sizes around the 4 KB half, its per-rank slots, and a few tens of KB (odd on purpose).
const size_t kSizes[] = {0, 1, 63, 1365, 4095, 4096, 4097, 9001, 30011};

class Collectives : public ::testing::TestWithParam<int> {};

TEST_P(Collectives, BroadcastFromEveryRoot) {
  const int n = GetParam();
  runGroup(n, smallOptions(), [&](shm::ShmGroup& g) {
    uint64_t seq = 0;
    for (size_t bytes : {size_t{0}, size_t{1}, size_t{4096}, size_t{4097}, size_t{50001}}) {
      for (int root = 0; root < n; ++root) {
        const std::vector<char> want = block(bytes, root, 0, seq);
        std::vector<char> data = g.rank() == root ? want : std::vector<char>(bytes, static_cast<char>(0xFF));
        BroadcastOptions o;
        o.root = root;
        const size_t cut = bytes / 3;  // two spans: a coalesced broadcast
        o.data.add(data.data(), cut);
        o.data.add(data.data() + cut, bytes - cut);
        broadcast(g, o, ctxFor("broadcast", ++seq));
        EXPECT_TRUE(data == want) << "bytes=" << bytes << " root=" << root << " rank=" << g.rank();
      }
    }
  });
}

// Contribution of rank r in step t: sizes differ between ranks, and some are empty.
size_t contribution(int r, uint64_t t) { return kSizes[(r * 3 + t) % std::size(kSizes)]; }

TEST_P(Collectives, AllgatherUnevenContributions) {
  const int n = GetParam();
  runGroup(n, smallOptions(), [&](shm::ShmGroup& g) {
    const int me = g.rank();
    for (uint64_t t = 0; t < std::size(kSizes); ++t) {
      const std::vector<char> mine = block(contribution(me, t), me, 0, t);
      std::vector<std::vector<char>> out(n);
      AllgatherOptions o;
      o.in = Span{const_cast<char*>(mine.data()), mine.size()};
      for (int p = 0; p < n; ++p) {
        out[p].assign(contribution(p, t), static_cast<char>(0xFF));
        o.out.push_back(Span{out[p].data(), out[p].size()});
      }
      allgather(g, o, ctxFor("all_gather", t + 1));
      for (int p = 0; p < n; ++p) {
        EXPECT_TRUE(out[p] == block(contribution(p, t), p, 0, t)) << "step " << t << " rank " << me << " from " << p;
      }
    }
  });
}

TEST_P(Collectives, AllgatherEqualSizes) {
  const int n = GetParam();
  runGroup(n, smallOptions(), [&](shm::ShmGroup& g) {
    const int me = g.rank();
    uint64_t seq = 0;
    for (size_t bytes : kSizes) {
      const std::vector<char> mine = block(bytes, me, 1, seq);
      std::vector<char> flat(bytes * n, static_cast<char>(0xFF));  // all_gather_into_tensor
      AllgatherOptions o;
      o.in = Span{const_cast<char*>(mine.data()), bytes};
      for (int p = 0; p < n; ++p) o.out.push_back(Span{flat.data() + p * bytes, bytes});
      allgather(g, o, ctxFor("all_gather_into_tensor", ++seq));
      for (int p = 0; p < n; ++p) {
        EXPECT_TRUE(equal(flat.data() + p * bytes, block(bytes, p, 1, seq - 1))) << "bytes=" << bytes << " p=" << p;
      }
    }
  });
}

// all_gather_into_tensor in place (the input is the rank's own slot of the output, as FSDP's
// flat parameter may be), through shared memory and through direct reads of the peers' inputs.
TEST_P(Collectives, AllgatherInPlaceOnBothRoutes) {
  const int n = GetParam();
  for (int64_t direct : {int64_t{0}, int64_t{1}}) {
    shm::ShmOptions opts = smallOptions();
    opts.singleCopyBytes = direct;  // 1: every non-empty all_gather reads the peers directly
    runGroup(n, opts, [&](shm::ShmGroup& g) {
      const int me = g.rank();
      uint64_t seq = 0;
      for (size_t bytes : kSizes) {
        std::vector<char> flat(bytes * n, static_cast<char>(0xFF));
        const std::vector<char> mine = block(bytes, me, 2, seq);
        std::copy(mine.begin(), mine.end(), flat.begin() + me * bytes);
        AllgatherOptions o;
        o.in = Span{flat.data() + me * bytes, bytes};
        for (int p = 0; p < n; ++p) o.out.push_back(Span{flat.data() + p * bytes, bytes});
        allgather(g, o, ctxFor("all_gather_into_tensor", ++seq));
        for (int p = 0; p < n; ++p) {
          EXPECT_TRUE(equal(flat.data() + p * bytes, block(bytes, p, 2, seq - 1)))
              << "direct=" << direct << " bytes=" << bytes << " p=" << p;
        }
      }
    });
  }
}

TEST_P(Collectives, GatherToEveryRoot) {
  const int n = GetParam();
  runGroup(n, smallOptions(), [&](shm::ShmGroup& g) {
    const int me = g.rank();
    uint64_t seq = 0;
    for (uint64_t t = 0; t < std::size(kSizes); ++t) {
      for (bool uneven : {false, true}) {
        for (int root = 0; root < n; ++root) {
          auto size = [&](int r) { return uneven ? contribution(r, t) : kSizes[t]; };
          const std::vector<char> mine = block(size(me), me, root, t);
          std::vector<std::vector<char>> out(n);
          AllgatherOptions o;
          o.in = Span{const_cast<char*>(mine.data()), mine.size()};
          o.root = root;
          if (me == root) {
            for (int p = 0; p < n; ++p) {
              out[p].assign(size(p), static_cast<char>(0xFF));
              o.out.push_back(Span{out[p].data(), out[p].size()});
            }
          }
          allgather(g, o, ctxFor("gather", ++seq));
          if (me != root) continue;
          for (int p = 0; p < n; ++p) {
            EXPECT_TRUE(out[p] == block(size(p), p, root, t))
                << "step " << t << (uneven ? " uneven" : "") << " root " << root << " from " << p;
          }
        }
      }
    }
  });
}

TEST_P(Collectives, ScatterFromEveryRoot) {
  const int n = GetParam();
  runGroup(n, smallOptions(), [&](shm::ShmGroup& g) {
    const int me = g.rank();
    uint64_t seq = 0;
    for (size_t bytes : kSizes) {
      for (int root = 0; root < n; ++root) {
        std::vector<std::vector<char>> blocks;
        ScatterOptions o;
        o.root = root;
        if (me == root) {
          for (int p = 0; p < n; ++p) {
            blocks.push_back(block(bytes, root, p, seq));
            o.in.push_back(Span{blocks.back().data(), bytes});
          }
        }
        std::vector<char> out(bytes, static_cast<char>(0xFF));
        o.out = Span{out.data(), bytes};
        scatter(g, o, ctxFor("scatter", ++seq));
        EXPECT_TRUE(out == block(bytes, root, me, seq - 1)) << "bytes=" << bytes << " root=" << root;
      }
    }
  });
}

TEST_P(Collectives, ReduceScatterEveryDtype) {
  const int n = GetParam();
  const std::vector<std::pair<DataType, ReduceOp>> combos = {
      {DataType::kFloat32, ReduceOp::kSum}, {DataType::kFloat16, ReduceOp::kSum}, {DataType::kBFloat16, ReduceOp::kAvg},
      {DataType::kFloat64, ReduceOp::kMax}, {DataType::kInt32, ReduceOp::kSum},   {DataType::kInt64, ReduceOp::kProduct},
      {DataType::kUInt8, ReduceOp::kBxor},  {DataType::kBool, ReduceOp::kMin}};
  // in[rank][dest]: rank's contribution to dest's block.
  auto input = [&](DataType dt, size_t count, int rank, int dest, uint64_t t) {
    return randomElements(dt, count, (t * 17 + rank) * 17 + dest);
  };
  runGroup(n, smallOptions(), [&](shm::ShmGroup& g) {
    const int me = g.rank();
    uint64_t seq = 0;
    for (auto [dt, op] : combos) {
      for (size_t count : {0, 1, 1001, 7777}) {
        ++seq;
        const size_t bytes = count * elementSize(dt);
        std::vector<char> flat(bytes * n);  // reduce_scatter_tensor: one input tensor of n blocks
        ReduceScatterOptions o;
        for (int d = 0; d < n; ++d) {
          const std::vector<char> b = input(dt, count, me, d, seq);
          std::copy(b.begin(), b.end(), flat.begin() + d * bytes);
          o.in.push_back(Span{flat.data() + d * bytes, bytes});
        }
        std::vector<char> out(bytes, static_cast<char>(0xFF));
        o.out = Span{out.data(), bytes};
        o.dtype = dt;
        o.op = op;
        reduceScatter(g, o, ctxFor("reduce_scatter", seq));
        std::vector<std::vector<char>> contributions;
        std::vector<const void*> ptrs;
        for (int r = 0; r < n; ++r) contributions.push_back(input(dt, count, r, me, seq));
        for (auto& c : contributions) ptrs.push_back(c.data());
        EXPECT_TRUE(out == refReduce(ptrs, count, dt, op))
            << dataTypeName(dt) << " " << reduceOpName(op) << " count=" << count << " rank=" << me;
      }
    }
  });
}

// Bytes rank src sends to rank dst in step t: uneven, many zero-size blocks, some whole rows zero.
size_t a2aBytes(int src, int dst, uint64_t t) {
  static const size_t sizes[] = {0, 1, 100, 0, 4096, 9999, 0, 20011, 3};
  if (t == 0) return 0;           // everything empty
  if (t == 1) return 5000;        // even blocks
  if (t == 2 && src == 1) return 0;  // one rank sends nothing
  return sizes[(src * 5 + dst * 3 + t) % std::size(sizes)];
}

TEST_P(Collectives, AlltoallUnevenBlocks) {
  const int n = GetParam();
  runGroup(n, smallOptions(), [&](shm::ShmGroup& g) {
    const int me = g.rank();
    for (uint64_t t = 0; t < 12; ++t) {
      std::vector<std::vector<char>> in(n), out(n);
      AlltoallOptions o;
      for (int q = 0; q < n; ++q) {
        in[q] = block(a2aBytes(me, q, t), me, q, t);
        o.in.push_back(Span{in[q].data(), in[q].size()});
        out[q].assign(a2aBytes(q, me, t), static_cast<char>(0xFF));
        o.out.push_back(Span{out[q].data(), out[q].size()});
      }
      alltoall(g, o, ctxFor("all_to_all", t + 1));
      for (int p = 0; p < n; ++p) {
        EXPECT_TRUE(out[p] == block(a2aBytes(p, me, t), p, me, t)) << "step " << t << " rank " << me << " from " << p;
      }
    }
  });
}

TEST_P(Collectives, BarrierHoldsEveryRankBack) {
  const int n = GetParam();
  std::atomic<int> arrived{0};
  runGroup(n, smallOptions(), [&](shm::ShmGroup& g) {
    for (int i = 1; i <= 50; ++i) {
      arrived.fetch_add(1);
      barrier(g, ctxFor("barrier", i));
      EXPECT_GE(arrived.load(), n * i) << "rank " << g.rank() << " left barrier " << i << " early";
      barrier(g, ctxFor("barrier", i));  // nobody starts the next round before all checked
    }
  });
}

// A random mix of every collective on one group, so buffer halves are reused across operations
// with different numbers of rounds. Every rank draws the same sequence from the same seed.
TEST_P(Collectives, MixedSequence) {
  const int n = GetParam();
  runGroup(n, smallOptions(), [&](shm::ShmGroup& g) {
    const int me = g.rank();
    std::mt19937 rng(42);
    for (uint64_t t = 1; t <= 60; ++t) {
      const size_t bytes = kSizes[rng() % std::size(kSizes)] & ~size_t{3};
      const int root = static_cast<int>(rng() % n);
      auto ctx = ctxFor("mixed", t);
      switch (rng() % 5) {
        case 0: {
          std::vector<char> v = randomElements(DataType::kInt32, bytes / 4, t * 10 + me), out(bytes);
          AllreduceOptions o;
          o.in = SpanList(v.data(), bytes);
          o.out = SpanList(out.data(), bytes);
          o.dtype = DataType::kInt32;
          allreduce(g, o, ctx);
          std::vector<std::vector<char>> all;
          std::vector<const void*> ptrs;
          for (int r = 0; r < n; ++r) all.push_back(randomElements(DataType::kInt32, bytes / 4, t * 10 + r));
          for (auto& a : all) ptrs.push_back(a.data());
          EXPECT_TRUE(out == refReduce(ptrs, bytes / 4, DataType::kInt32, ReduceOp::kSum)) << "step " << t;
          break;
        }
        case 1: {
          std::vector<char> v = me == root ? block(bytes, root, 0, t) : std::vector<char>(bytes);
          BroadcastOptions o;
          o.data = SpanList(v.data(), bytes);
          o.root = root;
          broadcast(g, o, ctx);
          EXPECT_TRUE(v == block(bytes, root, 0, t)) << "step " << t;
          break;
        }
        case 2: {
          std::vector<char> mine = block(bytes, me, 0, t), flat(bytes * n);
          AllgatherOptions o;
          o.in = Span{mine.data(), bytes};
          for (int p = 0; p < n; ++p) o.out.push_back(Span{flat.data() + p * bytes, bytes});
          allgather(g, o, ctx);
          for (int p = 0; p < n; ++p) EXPECT_TRUE(equal(flat.data() + p * bytes, block(bytes, p, 0, t))) << t;
          break;
        }
        case 3: {
          std::vector<std::vector<char>> in(n), out(n);
          AlltoallOptions o;
          for (int q = 0; q < n; ++q) {
            in[q] = block(bytes / (q + 1), me, q, t);
            out[q].resize(bytes / (me + 1));
            o.in.push_back(Span{in[q].data(), in[q].size()});
            o.out.push_back(Span{out[q].data(), out[q].size()});
          }
          alltoall(g, o, ctx);
          for (int p = 0; p < n; ++p) EXPECT_TRUE(out[p] == block(bytes / (me + 1), p, me, t)) << "step " << t;
          break;
        }
        default:
          barrier(g, ctx);
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Collectives, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return str("world", info.param); });

}  // namespace
}  // namespace tdx::test
