// streamCopy against memcpy, and PeerCopy's choice of stores: it settles on the kind whose calls
// take less time, tries the other one now and then, and every rank of a group tries it in the same
// calls.
#include "collectives/stream_copy.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace tdx {
namespace {

TEST(StreamCopy, CopiesEveryByteAtEveryAlignmentAndSize) {
  std::vector<char> src(70000), dst(70000 + 64), want(70000 + 64);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<char>(i * 131 + 7);
  for (size_t n : {size_t{0}, size_t{1}, size_t{63}, tuning::kStreamMinBytes - 1, tuning::kStreamMinBytes, tuning::kStreamMinBytes + 17,
                   size_t{65536} + 5}) {
    for (size_t align : {0, 1, 8, 15, 16, 33}) {
      std::memset(dst.data(), 0x5a, dst.size());
      std::memset(want.data(), 0x5a, want.size());
      std::memcpy(want.data() + align, src.data() + 3, n);
      streamCopy(dst.data() + align, src.data() + 3, n);
      ASSERT_EQ(0, std::memcmp(dst.data(), want.data(), dst.size())) << "n " << n << " align " << align;
    }
  }
}

void spin(std::chrono::microseconds d) {
  const auto until = std::chrono::steady_clock::now() + d;
  while (std::chrono::steady_clock::now() < until) {
  }
}

// Runs `calls` calls of `op` (1 MiB class unless `bytes` says otherwise, 64 KiB copied each) where calls that use streaming
// stores (`slowStreaming`) or ordinary ones take 300 us longer; returns how many of the last `last`
// calls used the slow kind.
int slowKindCalls(PeerOp op, bool slowStreaming, int calls, int last, size_t bytes = size_t{1} << 20) {
  std::vector<char> src(64 << 10, 1), dst(64 << 10);
  int used = 0;
  for (int seq = 0; seq < calls; ++seq) {
    PeerCopy copy(op, bytes, seq);
    copy(dst.data(), src.data(), src.size());
    if (copy.streaming() == slowStreaming) {
      spin(std::chrono::microseconds(300));
      if (seq >= calls - last) ++used;
    }
  }
  return used;
}

bool storeKindForced() {
  const char* v = std::getenv("TDX_SHM_STREAM");
  return v != nullptr && *v != '\0' && std::string(v) != "auto";
}

TEST(PeerCopy, SettlesOnTheKindWhoseCallsTakeLessAndTriesTheOtherNowAndThen) {
  if (storeKindForced()) GTEST_SKIP() << "TDX_SHM_STREAM forces a kind of store";
  // TDX_SHM_STREAM unset (auto). Each op keeps its own times: streaming slow for all_reduce,
  // ordinary stores slow for broadcast.
  const int calls = 400, last = 200;
  const int streamingSlow = slowKindCalls(PeerOp::kAllreduce, /*slowStreaming=*/true, calls, last);
  const int ordinarySlow = slowKindCalls(PeerOp::kBroadcast, /*slowStreaming=*/false, calls, last);
  // About one call in 64 tries the other kind: a few of the last 200, not none, far from half.
  EXPECT_GE(streamingSlow, 1);
  EXPECT_LE(streamingSlow, 20);
  EXPECT_GE(ordinarySlow, 1);
  EXPECT_LE(ordinarySlow, 20);
}

// A reader that copies nothing notes no time: a broadcast's non-roots do not count as calls of the
// class (their first touch would otherwise be skipped on the wrong rank) nor time it.
TEST(PeerCopy, CallsThatCopyNothingAreNotCounted) {
  if (storeKindForced()) GTEST_SKIP() << "TDX_SHM_STREAM forces a kind of store";
  std::vector<char> src(64 << 10, 1), dst(64 << 10);
  for (int seq = 0; seq < 100; ++seq) {
    PeerCopy reader(PeerOp::kAllgather, size_t{1} << 20, seq);  // copies nothing
  }
  // Still warming up: the first two copying calls take ordinary stores, the third measures
  // ordinary stores, the fourth streaming ones.
  std::vector<bool> kinds;
  for (int seq = 100; seq < 104; ++seq) {
    PeerCopy copy(PeerOp::kAllgather, size_t{1} << 20, seq);
    copy(dst.data(), src.data(), src.size());
    kinds.push_back(copy.streaming());
  }
  EXPECT_EQ(kinds, (std::vector<bool>{false, false, false, true}));
}

// Below tuning::kChooseMinBytes a call takes ordinary stores, however long its calls take; from there its
// class measures both kinds (the fourth call tries streaming stores).
TEST(PeerCopy, SmallCallsTakeOrdinaryStores) {
  if (storeKindForced()) GTEST_SKIP() << "TDX_SHM_STREAM forces a kind of store";
  std::vector<char> src(tuning::kStreamMinBytes, 1), dst(tuning::kStreamMinBytes);
  for (int seq = 0; seq < 300; ++seq) {
    for (size_t bytes : {tuning::kStreamMinBytes, tuning::kChooseMinBytes - 1}) {
      PeerCopy copy(PeerOp::kScatter, bytes, seq);
      copy(dst.data(), src.data(), src.size());
      ASSERT_FALSE(copy.streaming()) << bytes << " bytes, call " << seq;
      spin(std::chrono::microseconds(50));  // slow ordinary stores, were they measured
    }
  }
  bool streamed = false;
  for (int seq = 0; seq < 8 && !streamed; ++seq) {
    PeerCopy copy(PeerOp::kScatter, tuning::kChooseMinBytes, seq);
    copy(dst.data(), src.data(), src.size());
    streamed = copy.streaming();
    if (!streamed) spin(std::chrono::microseconds(50));
  }
  EXPECT_TRUE(streamed);
}

// A trial's kind follows from the sequence number alone, not from the kind in use: two classes
// that settled on different kinds (as two ranks that disagree would have) store the same way in
// every trial, so a trial times one kind on every rank, never a mix.
TEST(PeerCopy, TrialsStoreTheSameWayWhateverKindIsInUse) {
  if (storeKindForced()) GTEST_SKIP() << "TDX_SHM_STREAM forces a kind of store";
  const size_t ordinaryClass = size_t{1} << 20, streamingClass = size_t{1} << 21;
  slowKindCalls(PeerOp::kAlltoall, /*slowStreaming=*/true, 64, 0, ordinaryClass);
  slowKindCalls(PeerOp::kAlltoall, /*slowStreaming=*/false, 64, 0, streamingClass);
  std::vector<char> src(64 << 10, 1), dst(64 << 10);
  int trials = 0, streamingTrials = 0;
  for (int seq = 5000; seq < 5600; ++seq) {
    bool kind[2];
    for (int c = 0; c < 2; ++c) {  // each class's call timed on its own; the kind it settled on is the fast one
      PeerCopy copy(PeerOp::kAlltoall, c == 0 ? ordinaryClass : streamingClass, seq);
      copy(dst.data(), src.data(), src.size());
      kind[c] = copy.streaming();
      if (kind[c] == (c == 0)) spin(std::chrono::microseconds(300));
    }
    if (kind[0] == kind[1]) {  // a trial (outside trials the classes use their own kinds)
      ++trials;
      if (kind[0]) ++streamingTrials;
    } else {
      ASSERT_FALSE(kind[0]) << "call " << seq;
    }
  }
  // One call in 32 is a trial, of either kind.
  EXPECT_GE(trials, 8);
  EXPECT_LE(trials, 40);
  EXPECT_GE(streamingTrials, 2);
  EXPECT_LE(streamingTrials, trials - 2);
}

TEST(PeerCopy, RanksOfAGroupTryTheOtherKindInTheSameCalls) {
  if (storeKindForced()) GTEST_SKIP() << "TDX_SHM_STREAM forces a kind of store";
  // Two "ranks" with the same history per call: ordinary stores measured faster for both (streaming
  // slowed), so the calls where either uses streaming stores are its trials, chosen from the
  // sequence number alone.
  slowKindCalls(PeerOp::kReduceScatter, /*slowStreaming=*/true, 64, 0);  // learn: streaming slow
  std::vector<char> src(64 << 10, 1), dst(64 << 10);
  std::vector<int> trials[2];
  for (int seq = 1000; seq < 1400; ++seq) {
    for (int rank = 0; rank < 2; ++rank) {
      PeerCopy copy(PeerOp::kReduceScatter, size_t{1} << 20, seq);
      copy(dst.data(), src.data(), src.size());
      if (copy.streaming()) {
        trials[rank].push_back(seq);
        spin(std::chrono::microseconds(300));
      }
    }
  }
  EXPECT_EQ(trials[0], trials[1]);
  EXPECT_GE(trials[0].size(), 2u);
  EXPECT_LE(trials[0].size(), 20u);
}

}  // namespace
}  // namespace tdx
