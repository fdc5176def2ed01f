// allreduce and reduce (root >= 0) for 1..4 thread ranks, both algorithms, against the
// single-threaded reference of reduce_reference.h. halfBytes = 4096 forces many rounds, full and
// partial slices (and empty slices on high ranks) on inputs of a few tens of KB.
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "collectives/collectives.h"
#include "tuning/plan.h"
#include "reduce_reference.h"
#include "thread_ranks.h"

namespace tdx::test {
namespace {

struct Case {
  DataType dt;
  ReduceOp op;
  size_t count;
  int root;  // -1: allreduce
  bool inPlace;
};

std::string describe(const Case& c) {
  return str(dataTypeName(c.dt), " ", reduceOpName(c.op), " count=", c.count, " root=", c.root,
             c.inPlace ? " in-place" : "");
}

// Splits [p, p + bytes) into several spans at element boundaries (a coalesced operation).
// Variant 1 adds an empty span, as an empty tensor in a coalesced list would.
SpanList splitSpans(char* p, size_t bytes, size_t elem, int variant) {
  SpanList l;
  const size_t count = bytes / elem;
  const size_t a = variant == 0 ? count / 3 : count / 2, b = std::min(count, a + 1 + variant);
  l.add(p, a * elem);
  if (variant == 1) l.add(p, 0);
  l.add(p + a * elem, (b - a) * elem);
  l.add(p + b * elem, bytes - b * elem);
  return l;
}

using Param = std::tuple<int, AllreduceAlgorithm, size_t>;  // world size, algorithm, halfBytes

// Runs every case, in order, on one group of n thread ranks and checks every rank's output.
void runCases(const Param& param, const std::vector<Case>& cases) {
  const auto [n, algo, halfBytes] = param;
  // Inputs and expected results, computed up front on this thread.
  std::vector<std::vector<std::vector<char>>> inputs(cases.size());
  std::vector<std::vector<char>> expected(cases.size());
  for (size_t c = 0; c < cases.size(); ++c) {
    std::vector<const void*> ptrs;
    for (int r = 0; r < n; ++r) {
      inputs[c].push_back(randomElements(cases[c].dt, cases[c].count, 1000 * c + r));
      ptrs.push_back(inputs[c].back().data());
    }
    expected[c] = refReduce(ptrs, cases[c].count, cases[c].dt, cases[c].op);
  }
  std::vector<std::vector<std::vector<char>>> outputs(cases.size(), std::vector<std::vector<char>>(n));
  shm::ShmOptions opts = smallOptions();
  opts.halfBytes = halfBytes;
  runGroup(n, opts, [&](shm::ShmGroup& g) {
    const int me = g.rank();
    for (size_t c = 0; c < cases.size(); ++c) {
      const Case& k = cases[c];
      const size_t elem = elementSize(k.dt), bytes = k.count * elem;
      std::vector<char> in = inputs[c][me];
      std::vector<char>& out = outputs[c][me];
      out.assign(bytes, static_cast<char>(0xFF));
      char* outPtr = k.inPlace ? in.data() : out.data();
      AllreduceOptions o;
      o.in = splitSpans(in.data(), bytes, elem, 0);
      o.out = splitSpans(outPtr, bytes, elem, 1);
      o.dtype = k.dt;
      o.op = k.op;
      o.root = k.root;
      o.algorithm = algo;
      o.oneshotBytes = 1024;  // kAuto: one-shot up to 1 KB, reduce-scatter + all-gather above
      allreduce(g, o, ctxFor(k.root >= 0 ? "reduce" : "allreduce", c + 1));
      if (k.inPlace) out = in;
    }
  });
  for (size_t c = 0; c < cases.size(); ++c) {
    const Case& k = cases[c];
    for (int r = 0; r < n; ++r) {
      const std::vector<char>& got = outputs[c][r];
      if (k.root < 0 || k.root == r) {
        EXPECT_TRUE(got == expected[c]) << describe(k) << ": wrong result on rank " << r;
      } else {
        // Only the root receives the result: the others' outputs are left alone.
        const std::vector<char> untouched =
            k.inPlace ? inputs[c][r] : std::vector<char>(got.size(), static_cast<char>(0xFF));
        EXPECT_TRUE(got == untouched) << describe(k) << ": non-root rank " << r << " output was written";
      }
    }
    // Bit-identical on every rank that receives the result (float sums depend on fold order).
    if (k.root < 0) {
      for (int r = 1; r < n; ++r) EXPECT_TRUE(outputs[c][r] == outputs[c][0]) << describe(k) << " rank " << r;
    }
  }
}

class Allreduce : public ::testing::TestWithParam<Param> {};

TEST_P(Allreduce, Float32SumEverySizeRootAndPlacement) {
  const int n = std::get<0>(GetParam());
  std::vector<Case> cases;
  // 1023/1024/1025 floats straddle one 4 KB half; 12345 and 30001 floats need many rounds with a
  // partial last round whose slices are uneven (some empty for high ranks).
  for (size_t count : {0, 1, 5, 17, 25, 1023, 1024, 1025, 12345, 30001}) {
    for (int root : {-1, 0, n - 1}) {
      for (bool inPlace : {false, true}) cases.push_back({DataType::kFloat32, ReduceOp::kSum, count, root, inPlace});
    }
  }
  runCases(GetParam(), cases);
}

TEST_P(Allreduce, EveryDtypeAndOp) {
  const int n = std::get<0>(GetParam());
  const std::vector<std::pair<DataType, ReduceOp>> combos = {
      {DataType::kFloat32, ReduceOp::kMin},   {DataType::kFloat32, ReduceOp::kAvg},
      {DataType::kFloat64, ReduceOp::kSum},   {DataType::kFloat64, ReduceOp::kProduct},
      {DataType::kFloat16, ReduceOp::kSum},   {DataType::kFloat16, ReduceOp::kMax},
      {DataType::kBFloat16, ReduceOp::kAvg},  {DataType::kBFloat16, ReduceOp::kSum},
      {DataType::kInt8, ReduceOp::kProduct},  {DataType::kInt16, ReduceOp::kSum},
      {DataType::kInt32, ReduceOp::kSum},     {DataType::kInt32, ReduceOp::kBxor},
      {DataType::kInt64, ReduceOp::kMax},     {DataType::kInt64, ReduceOp::kSum},
      {DataType::kUInt8, ReduceOp::kMin},     {DataType::kUInt8, ReduceOp::kBor},
      {DataType::kBool, ReduceOp::kSum},      {DataType::kBool, ReduceOp::kBand},
  };
  std::vector<Case> cases;
  for (auto [dt, op] : combos) {
    for (size_t count : {3, 777, 10007}) {
      cases.push_back({dt, op, count, -1, false});
      cases.push_back({dt, op, count, n - 1, count == 777});
    }
  }
  runCases(GetParam(), cases);
}

std::string paramName(const ::testing::TestParamInfo<Param>& info) {
  const auto [n, algo, half] = info.param;
  const char* a = algo == AllreduceAlgorithm::kOneShot ? "OneShot"
                  : algo == AllreduceAlgorithm::kAuto  ? "Auto"
                                                       : "ReduceScatterAllgather";
  return str("world", n, "_", a, "_half", half);
}

// Unset, the one-shot limit shrinks with the square of the rank count (one-shot reads every rank's
// whole message).
TEST(AllreduceOneshotLimit, ShrinksWithTheRankCount) {
  const DataType f32 = DataType::kFloat32;
  EXPECT_EQ(tuning::oneshotLimit(1, f32), size_t{128} << 10);
  EXPECT_EQ(tuning::oneshotLimit(2, f32), size_t{64} << 10);
  EXPECT_EQ(tuning::oneshotLimit(3, f32), (size_t{256} << 10) / 9);
  EXPECT_EQ(tuning::oneshotLimit(4, f32), size_t{16} << 10);
  EXPECT_EQ(tuning::oneshotLimit(8, DataType::kInt64), size_t{4} << 10);
  EXPECT_EQ(tuning::oneshotLimit(64, f32), size_t{4} << 10);
  // fp16 / bf16 folds convert every element: reduce-scatter + all-gather pays from 8 KiB.
  EXPECT_EQ(tuning::oneshotLimit(2, DataType::kBFloat16), size_t{4} << 10);
  EXPECT_EQ(tuning::oneshotLimit(8, DataType::kFloat16), size_t{4} << 10);
  EXPECT_EQ(AllreduceOptions{}.oneshotBytes, kAutoOneshot);
}

INSTANTIATE_TEST_SUITE_P(
    Paths, Allreduce,
    ::testing::Combine(::testing::Values(1, 2, 3, 4),
                       ::testing::Values(AllreduceAlgorithm::kOneShot, AllreduceAlgorithm::kReduceScatterAllgather,
                                         AllreduceAlgorithm::kAuto),
                       ::testing::Values(size_t{4096}, size_t{128} << 10)),
    paramName);

}  // namespace
}  // namespace tdx::test
