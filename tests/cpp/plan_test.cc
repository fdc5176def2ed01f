// The decision room as a table: what tuning::plan chooses for every collective and size in the
// groups tdx is measured on. The table is printed and pinned: a change of any choice shows here as
// a diff, to be justified by a measurement (docs/bench) before the pinned text is updated.
#include "tuning/plan.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

namespace tdx::tuning {
namespace {

struct NamedGroup {
  const char* name;
  Group group;
};

Group group(int ranks, int hosts, double linkBytesPerSec = 0, bool uniform = true, bool amd = false) {
  Group g;
  g.ranks = ranks;
  g.hosts = hosts;
  g.localSize = uniform ? ranks / hosts : (ranks + hosts - 1) / hosts;
  g.uniform = uniform;
  g.linkBytesPerSec = linkBytesPerSec;
  g.amdCpu = amd;
  return g;
}

constexpr double kGbit = 125e6;  // bytes per second

std::string human(uint64_t b) {
  char buf[32];
  if (b >= (1u << 20)) {
    std::snprintf(buf, sizeof(buf), "%lluM", static_cast<unsigned long long>(b >> 20));
  } else {
    std::snprintf(buf, sizeof(buf), "%lluK", static_cast<unsigned long long>(b >> 10));
  }
  return buf;
}

// One line per (group, op, size): "<group> | <op> <size> | <plan>".
std::string table(const std::vector<NamedGroup>& groups, const Knobs& knobs) {
  const std::vector<Op> sized = {Op::kAllreduce, Op::kReduce, Op::kBroadcast, Op::kAllgather, Op::kReduceScatter};
  const std::vector<uint64_t> sizes = {4u << 10, 64u << 10, 256u << 10, 1u << 20, 4u << 20, 16u << 20};
  std::string out;
  for (const auto& [name, g] : groups) {
    for (Op op : sized) {
      for (uint64_t bytes : sizes) {
        Call c;
        c.op = op;
        c.bytes = bytes;
        out += std::string(name) + " | " + opName(op) + " " + human(bytes) + " | " + plan(c, g, knobs).describe() +
               "\n";
      }
    }
    for (Op op : {Op::kGather, Op::kScatter, Op::kAlltoall, Op::kBarrier}) {
      Call c;
      c.op = op;
      c.bytes = op == Op::kBarrier ? 0 : 1u << 20;
      out += std::string(name) + " | " + opName(op) + (op == Op::kBarrier ? "" : " 1M") + " | " +
             plan(c, g, knobs).describe() + "\n";
    }
  }
  return out;
}

const std::vector<NamedGroup> kGroups = {
    {"1x2", group(2, 1)},
    {"1x2 amd", group(2, 1, 0, true, true)},
    {"1x8", group(8, 1)},
    {"2x2 unshaped", group(4, 2, 2000e6)},
    {"2x2 10gbit", group(4, 2, 10 * kGbit)},
    {"2x2 1gbit", group(4, 2, 1 * kGbit)},
    {"3x2 1gbit", group(6, 3, 1 * kGbit)},
    {"4x1", group(4, 4)},
    {"2+1", group(3, 2, 0, false)},
};

#include "plan_table.inc"  // kPinned: the table below, as it was last measured and agreed

// The shared-memory waits and the per-call choice of stores, as a table of their own.
std::string waitsAndStores() {
  std::string out;
  struct Shape {
    const char* name;
    int localSize, cores;
    bool multiHost;
  };
  for (const Shape& s : {Shape{"2 ranks on 2 cores", 2, 2, false}, Shape{"4 ranks on 2 cores", 4, 2, false},
                         Shape{"8 ranks on 16 cores", 8, 16, false}, Shape{"2 ranks on 16 cores, across hosts", 2, 16, true}}) {
    const ShmWait w = shmWait(s.localSize, s.cores, s.multiHost, Knobs{});
    out += std::string("wait | ") + s.name + " | spin " + std::to_string(w.spinUs) + " us, yield to " +
           std::to_string(w.yieldUs) + " us\n";
  }
  Knobs set;
  set.spinUs = 0;
  set.yieldUs = 300;
  const ShmWait w = shmWait(2, 2, false, set);
  out += "wait | TDX_SPIN_US=0 TDX_YIELD_US=300 | spin " + std::to_string(w.spinUs) + " us, yield to " +
         std::to_string(w.yieldUs) + " us\n";
  out += "stores | trial one call in " + std::to_string(1 << kStoreTrialBits) + ", first " +
         std::to_string(kStoreUnmeasuredCalls) + " calls unmeasured\n";
  for (uint64_t other : {100, 88, 87, 50}) {
    out += "stores | in use costs 100, other " + std::to_string(other) + " | " +
           (storesSwitch(100, other) ? "switch" : "stay") + "\n";
  }
  for (auto [old, sample, trial] : {std::tuple<uint64_t, uint64_t, bool>{0, 80, false}, {100, 80, false},
                                    {100, 1000, false}, {100, 1000, true}}) {
    out += "stores | cost " + std::to_string(old) + ", call " + std::to_string(sample) + (trial ? " (trial)" : "") +
           " | cost " + std::to_string(storesCost(old, sample, trial)) + "\n";
  }
  return out;
}

TEST(Plan, WaitsAndStoresArePinned) {
  const std::string t = waitsAndStores();
  std::printf("%s", t.c_str());
  EXPECT_EQ(t, kPinnedWaitsAndStores) << "a choice changed: justify it with a measurement, then update "
                                         "tests/cpp/plan_table.inc";
}

TEST(Plan, TableIsPinned) {
  const std::string t = table(kGroups, Knobs{});
  std::printf("%s", t.c_str());  // the table, for the log
  EXPECT_EQ(t, kPinned) << "a choice changed: justify it with a measurement, then update tests/cpp/plan_table.inc";
}

// Between two hosts a broadcast is always sliced (one send across, shared memory on the hosts);
// from three hosts a small one goes from the root to every rank.
TEST(Plan, BroadcastAcrossHosts) {
  Call c;
  c.op = Op::kBroadcast;
  c.bytes = 64u << 10;
  EXPECT_EQ(plan(c, group(4, 2, 1 * kGbit), Knobs{}).route, Route::kSliced);
  const Plan three = plan(c, group(6, 3, 1 * kGbit), Knobs{});
  EXPECT_EQ(three.route, Route::kFlat);
  EXPECT_EQ(three.link, LinkAlgo::kP2PFromRoot);
  c.bytes = 1u << 20;
  EXPECT_EQ(plan(c, group(6, 3, 1 * kGbit), Knobs{}).route, Route::kSliced);
}

// The knobs: TDX_XHOST_ALGO forces a route where both exist; compression keeps reductions sliced.
TEST(Plan, KnobsChooseTheRoute) {
  Knobs flat;
  flat.xhostAlgo = "flat";
  Call c;
  c.op = Op::kAllreduce;
  c.bytes = 1u << 20;
  EXPECT_EQ(plan(c, group(4, 2), flat).route, Route::kFlat);
  flat.xhostCompress = "int8";
  const Plan compressed = plan(c, group(4, 2), flat);
  EXPECT_EQ(compressed.route, Route::kSliced);
  EXPECT_EQ(std::string(compressed.compress), "int8");
  c.dtype = DataType::kFloat64;  // only float32 SUM / AVG are compressed
  EXPECT_EQ(plan(c, group(4, 2), flat).route, Route::kFlat);
  Knobs chunks;
  chunks.xhostChunkBytes = 64u << 10;
  c.dtype = DataType::kFloat32;
  c.bytes = 16u << 20;
  EXPECT_EQ(plan(c, group(4, 2), chunks).chunkBytes, (16u << 20) / 2 / 8);  // an eighth of a slice
  c.bytes = 256u << 10;
  EXPECT_EQ(plan(c, group(4, 2), chunks).chunkBytes, 64u << 10);  // the floor
}

// One host: one-shot up to the limit and one buffer half; single copy in its window; stores.
TEST(Plan, OneHost) {
  Knobs k;
  EXPECT_EQ(allreduceOnHost(64u << 10, 2, DataType::kFloat32, k.oneshotBytes, k.shmHalfBytes), HostAlgo::kOneShot);
  EXPECT_EQ(allreduceOnHost(64u << 10 | 4, 2, DataType::kFloat32, k.oneshotBytes, k.shmHalfBytes),
            HostAlgo::kReduceScatterAllgather);
  EXPECT_EQ(allreduceOnHost(1u << 20, 2, DataType::kFloat32, 2u << 20, 512u << 10),
            HostAlgo::kReduceScatterAllgather);  // larger than a half
  EXPECT_EQ(singleCopyOffer(4, false), size_t{16} << 10);
  EXPECT_EQ(singleCopyOffer(4, true), size_t{64} << 10);
  EXPECT_EQ(singleCopyOffer(8, false), 0u);
  EXPECT_EQ(singleCopyOffer(8, false, 1024), 1024u);
  EXPECT_TRUE(singleCopyAllgather(4u << 20, 2, 16u << 10));
  EXPECT_FALSE(singleCopyAllgather((4u << 20) + 1, 2, 16u << 10));
  EXPECT_FALSE(singleCopyAllgather(1u << 20, 1, 16u << 10));
  EXPECT_EQ(storesFor(kChooseMinBytes - 1, -1), Stores::kOrdinary);
  EXPECT_EQ(storesFor(kChooseMinBytes, -1), Stores::kMeasured);
  EXPECT_EQ(storesFor(4, 1), Stores::kStreaming);
  EXPECT_EQ(storesFor(1u << 20, 0), Stores::kOrdinary);
}

}  // namespace
}  // namespace tdx::tuning
