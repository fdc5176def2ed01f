// The one room for decisions: which algorithm a call takes, and every threshold behind the choice.
// plan() is a pure function of the call (op, bytes, dtype, reduce op), the group (ranks, hosts,
// ranks per host, the host link's measured rate, the CPU) and the knobs; the engines ask it (or
// the smaller functions below, which it is made of) and nothing else chooses an algorithm. So the
// choice can be read as a table (tests/cpp/plan_test.cc pins one; `python -m torchdist_ext.bench
// plan` prints it for a given group) without reading the algorithms.
//
// Torch-free: the caller reads the knobs (knobs.h) and the link rate.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "collectives/types.h"

namespace tdx::tuning {

// The collectives as the planner sees them.
enum class Op : uint8_t { kAllreduce, kReduce, kBroadcast, kAllgather, kReduceScatter, kGather, kScatter, kAlltoall,
                          kBarrier };
const char* opName(Op op);

// The knobs that change a choice (common/env.h documents each).
struct Knobs {
  std::string xhostAlgo = "auto";      // TDX_XHOST_ALGO: auto, sliced, flat
  std::string xhostCompress = "none";  // TDX_XHOST_COMPRESS: none, bf16, fp16, int8
  size_t xhostChunkBytes = 0;          // TDX_XHOST_CHUNK_BYTES (0: from the link rate)
  size_t oneshotBytes = SIZE_MAX;      // TDX_ONESHOT_BYTES (SIZE_MAX: oneshotLimit's default)
  size_t singleCopyBytes = SIZE_MAX;   // TDX_SINGLE_COPY_BYTES (SIZE_MAX: singleCopyOffer's default)
  int shmStream = -1;                  // TDX_SHM_STREAM: 1 streaming, 0 ordinary, -1 measured per call
  size_t shmHalfBytes = 512u << 10;    // TDX_BUFFER_BYTES rounded to a page: one buffer half (one-shot fits in it)
  int spinUs = -1;                     // TDX_SPIN_US (-1: shmWait's default)
  int yieldUs = -1;                    // TDX_YIELD_US (-1: shmWait's default)
};

// The group, as every rank of it sees it alike.
struct Group {
  int ranks = 1;
  int hosts = 1;
  int localSize = 1;             // ranks on each host (on this rank's host when not uniform)
  bool uniform = true;           // every host has localSize ranks
  double linkBytesPerSec = 0;    // per host link direction, measured at group creation (0: not measured)
  bool amdCpu = false;           // AMD's last-level cache is split between core complexes
  // The single-copy all_gather's threshold the host's ranks agreed on (0: off); SIZE_MAX: what
  // singleCopyOffer gives (every rank can read its peers' memory).
  size_t singleCopyBytes = SIZE_MAX;
};

// One call. `bytes`: the all_reduce / reduce / broadcast tensor, the all_gather output, the
// reduce_scatter and all_to_all input, the gather input / scatter output of one rank.
struct Call {
  Op op = Op::kAllreduce;
  uint64_t bytes = 0;
  DataType dtype = DataType::kFloat32;
  ReduceOp redop = ReduceOp::kSum;
  bool root = false;         // a reduce to a root (set for kReduce)
  bool equalBlocks = true;   // all_gather: every rank's block the same size
};

// Where the bytes go.
enum class Route : uint8_t {
  kShm,     // one host: shared memory
  kSliced,  // across hosts: local rank j carries slice j through its slice group (csrc/multihost/*_sliced.cc)
  kFlat,    // across hosts: one Gloo operation over all ranks (Gloo's own algorithm)
};
// The shared-memory algorithm on each host.
enum class HostAlgo : uint8_t {
  kNone,                    // nothing on the host (the whole call runs across hosts)
  kOneShot,                 // every rank folds every input in one step
  kReduceScatterAllgather,  // chunked and pipelined
  kSingleCopy,              // all_gather: every rank reads its peers' inputs directly
  kBuffered,                // through the buffer halves (the collective's only algorithm)
};
// The algorithm across hosts.
enum class LinkAlgo : uint8_t {
  kNone,
  kGlooAll,             // the op's Gloo collective over all ranks
  kGlooSlices,          // Gloo all_reduce (reduce: to the root's host) in the slice groups
  kSliceExchange,       // two hosts: the slice partials swapped (one Gloo all_gather) and summed in host order
  kChain,               // chunks passed host to host along a chain (Gloo p2p in the slice groups)
  kP2PFromRoot,         // the root sends to every rank (Gloo p2p on the calling thread)
  kGlooAllgatherSlices, // Gloo all_gather in the slice groups, chunked
  kP2PBlocks,           // every host's partial of a block sent to that block's host (Gloo p2p)
  kBroadcastEach,       // unequal blocks: every rank broadcasts its block in turn
  kP2PFirstRanks,       // barrier: the hosts' first ranks tell each other (Gloo p2p)
};
// How a call copies into shared memory that peers read next (collectives/stream_copy.h).
enum class Stores : uint8_t { kOrdinary, kMeasured, kStreaming };

const char* routeName(Route r);
const char* hostAlgoName(HostAlgo a);
const char* linkAlgoName(LinkAlgo a);
const char* storesName(Stores s);

struct Plan {
  Route route = Route::kShm;
  HostAlgo host = HostAlgo::kNone;
  LinkAlgo link = LinkAlgo::kNone;
  Stores stores = Stores::kOrdinary;
  // Across hosts.
  const char* compress = "none";  // the slices' form on the link: none, bf16, fp16, int8
  bool reduceAsAllreduce = false; // a reduce run as the sliced all_reduce (every rank gets the result)
  uint64_t chunkBytes = 0;        // the smallest chunk of a chunked transfer across hosts (0: not chunked)
  bool directGather = false;      // sliced all_gather: each host's part gathered straight into the outputs
  // "sliced: shm reduce-scatter+all-gather | slice exchange, chunks >= 512K" and the like.
  std::string describe() const;
};

Plan plan(const Call& call, const Group& group, const Knobs& knobs);

// ---- The parts plan() is made of; the engines call these where they act.

// Shared memory (one host, and the host phases of the sliced forms).
// The one-shot all_reduce limit for `ranks` ranks and `dtype` (`knob`: TDX_ONESHOT_BYTES) when none is set: 256 KiB / ranks^2, at most 128
// KiB and at least 4 KiB (64 KiB at 2 ranks, 16 KiB at 4, 4 KiB at 8); 4 KiB for fp16 and bf16.
// One-shot reads and folds ranks x bytes per rank in one synchronization; reduce-scatter +
// all-gather about 2 x bytes in two, so the size where one-shot stops paying falls faster than
// 1 / ranks. On 16 cores (docs/bench/cpu-16core-stream-ab.txt) one-shot at 8 ranks took 90-97 us
// for 64 KB, longer than reduce-scatter + all-gather for 256 KB (72-92 us); at 16 KB it took
// 23-30 us in four runs, where reduce-scatter + all-gather of bf16 (its fold converting every
// element) took 14.3 us in the same bench run (docs/bench/cpu-8rank-16core-anchors.txt); at 4
// ranks one-shot 16 KB took 14.0-15.1 us and bf16 reduce-scatter + all-gather 14.8, one-shot 64 KB
// 44 us and reduce-scatter + all-gather 25-28. A 16-bit fold converts every element to
// float and back, so it pays sooner: at 2 ranks, bf16 16 KB 7.5 us vs 12.4 one-shot, 64 KB 19.9
// vs 33.8; fp16 64 KB 15.8 vs 20.8 (fp32 64 KB one-shot 14.7 vs 15.3).
size_t oneshotLimit(int ranks, DataType dtype, size_t knob = SIZE_MAX);
// all_reduce / reduce of `bytes` on one host: one-shot up to the limit when it fits one buffer half.
HostAlgo allreduceOnHost(uint64_t bytes, int ranks, DataType dtype, size_t oneshotKnob, size_t halfBytes);
// The single-copy all_gather threshold this rank offers (0: off) when it can read its peers'
// memory; the group takes the largest offer if every rank offers.
size_t singleCopyOffer(int ranks, bool amdCpu, size_t knob = SIZE_MAX);
// Whether an all_gather (not a gather) of `outBytes` output reads the peers' inputs directly.
bool singleCopyAllgather(uint64_t outBytes, int ranks, size_t groupThreshold);
// Below this many bytes a copy into shared memory is a plain memcpy: it stays in the caches, where
// the peer reads it sooner than from memory.
inline constexpr size_t kStreamMinBytes = 16u << 10;
// Calls of fewer bytes take ordinary stores without measuring (TDX_SHM_STREAM=1 still forces
// streaming): there streaming saved about 4% where it won, and 2-rank all_reduce of 16 KB took
// 1.9x as long streaming in some minutes on the 2-core AMD VM, 11-28% longer at 4 and 8 ranks on
// the 16-core Intel machine; the whole call's time, at 8 ranks mostly the latest peer's arrival, is
// too noisy to choose from (docs/performance.md, "Which stores").
inline constexpr size_t kChooseMinBytes = 32u << 10;
// The stores of a call that copies `bytes` (shmStream: TDX_SHM_STREAM, -1 unset).
Stores storesFor(uint64_t bytes, int shmStream);
// How a call of Stores::kMeasured picks its kind (collectives/stream_copy.cc keeps the times, per
// op and power-of-two size class, in TSC ticks per KiB; plan.cc says why each rule is so).
// One call in 2^kStoreTrialBits is a trial of a kind chosen from the sequence number alone.
inline constexpr int kStoreTrialBits = 5;
// The first calls of an op and size class are counted, not measured.
inline constexpr uint32_t kStoreUnmeasuredCalls = 2;
// Whether a call switches from the kind in use (`mine`: its smoothed cost) to the other kind.
bool storesSwitch(uint64_t mine, uint64_t other);
// The smoothed cost of a kind after a call of cost `sample` (`old` 0: none yet; `trial`: a trial call).
uint64_t storesCost(uint64_t old, uint64_t sample, bool trial);

// How a rank waiting for a host mate in shared memory spends the wait: spinning for spinUs, then
// polling with sched_yield until yieldUs from the wait's start, then sleeping on a futex.
struct ShmWait {
  int spinUs = 0;
  int yieldUs = 0;
};
// `localSize` ranks on this host of `cores` usable cores (`multiHost`: the group spans hosts).
ShmWait shmWait(int localSize, int cores, bool multiHost, const Knobs& knobs);

// Across hosts.
// Whether the link measured at group creation is fast (more than 300 MB/s per direction).
bool fastLink(double linkBytesPerSec);
// Whether the group measures its host link when it is made (only "auto" uses the rate).
bool measuresLink(const Group& group, const Knobs& knobs);
// The smallest chunk of the sliced forms: TDX_XHOST_CHUNK_BYTES, else 2 MiB on a fast link (where
// each chunk's Gloo operation and shared-memory synchronization dominate), else 512 KiB.
uint64_t chunkFloorBytes(double linkBytesPerSec, size_t knob);
// Elements per chunk of `total` elements of `elementBytes` each: an eighth of the total, so the
// phases overlap, but at least the floor.
int64_t chunkElems(uint64_t floorBytes, size_t elementBytes, int64_t total);
// Whether TDX_XHOST_COMPRESS applies to a reduction of (dtype, op): float32 SUM/AVG only.
bool compressesOnLink(DataType dtype, ReduceOp op, const Knobs& knobs);
// The largest broadcast of the flat route sent as Gloo p2p from the root.
inline constexpr uint64_t kP2PBroadcastMax = 512u << 10;

}  // namespace tdx::tuning
